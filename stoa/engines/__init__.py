"""Generation engines: sample groups of completions and record the logprob of every sampled token.

Used by the worker loop, the trainer's evaluation, local mode and the benchmarks, always through the
``Engine`` protocol. Importing this package loads neither torch nor mlx.

- ``base``: the ``Engine`` protocol, ``Completion`` and ``GenStats``;
- ``sampling``: the sampling distribution every engine must reproduce (numpy reference);
- ``factory``: ``make_engine`` (an engine by name) and ``engine_from_model`` (wrap a loaded model);
- ``torch``: ``TorchEngine`` (CUDA or CPU, float32 or bf16);
- ``mlx``: ``MLXEngine`` and the MLX CPU quantized path (Apple silicon; ``mlx[cpu]`` on Linux);
- ``mlx_blas``: the Linux CPU BLAS MLX needs, loaded once by ``stoa.engines.mlx``.
"""

from stoa.engines.base import Completion, Engine, GenStats
from stoa.engines.factory import ENGINE_NAMES, default_engine, engine_from_model, make_engine

__all__ = ["ENGINE_NAMES", "Completion", "Engine", "GenStats", "default_engine", "engine_from_model", "make_engine"]
