"""Moved to ``stoa.engines.mlx.quantized``; kept for imports until the sweep."""

from stoa.engines.mlx.quantized import (
    ENV_QMM,
    BlasQuantizedEmbedding,
    BlasQuantizedLinear,
    dequantized_matmul,
    use_blas_for_quantized,
    wants_blas_qmm,
)

__all__ = ["ENV_QMM", "BlasQuantizedEmbedding", "BlasQuantizedLinear", "dequantized_matmul",
           "use_blas_for_quantized", "wants_blas_qmm"]
