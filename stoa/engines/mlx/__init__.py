"""The MLX engine (Apple silicon; ``mlx[cpu]`` on Linux), torch-free.

Python runs this file before any module below it, so this is the one place that gives MLX its CPU BLAS:
on Linux, Intel MKL must be loaded before the first ``import mlx.core`` of the process (see
:mod:`stoa.engines.mlx_blas`). Import what you need from the modules:

- ``stoa.engines.mlx.engine``: ``MLXEngine`` (generate, load_state, load_weights);
- ``stoa.engines.mlx.sampling``: the sampling distribution and the per-step draw;
- ``stoa.engines.mlx.quantized``: quantized layers on the CPU as dequantize + BLAS matmul.
"""

from stoa.engines.mlx_blas import prepare_mlx_blas

prepare_mlx_blas()
