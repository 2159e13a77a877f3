"""Moved to ``stoa.engines.mlx.engine`` (and ``stoa.engines.mlx.sampling``); kept for imports until the sweep."""

from stoa.engines.mlx.engine import DTYPES, PREFILL_CHUNK, MLXEngine, default_dtype
from stoa.engines.mlx.sampling import make_key, sampling_logprobs_mlx

__all__ = ["DTYPES", "PREFILL_CHUNK", "MLXEngine", "default_dtype", "make_key", "sampling_logprobs_mlx"]
