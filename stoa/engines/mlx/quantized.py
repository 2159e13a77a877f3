"""MLX on a CPU: quantized layers multiply by dequantizing to float32 and calling BLAS, not MLX's CPU kernel.

MLX's CPU ``quantized_matmul`` is a generic loop: 3.2 GFLOP/s on a [440, 576] x [576, 1536] 4-bit product
here, where dequantizing the weight (0.7 ms) and one MKL float32 matmul take 7.7 ms in all (32x; 2.7x at
4 rows). Metal's quantized kernels are fast, so only layers on the CPU device are switched. The switch
is numerically the kernel's own formula: ``code * scale + bias`` in float32 (scales and biases are widened
first, so a bf16 plane's scales are not rounded again), then a float32 product cast back to the input
dtype. The backward pass recomputes the dequantized weight instead of keeping it alive between forward
and backward, so activation memory stays what it was with the kernel. ``STOA_MLX_QMM=kernel`` opts out.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

ENV_QMM = "STOA_MLX_QMM"


def _dequantize(w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    return mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size,
                         bits=bits)


@cache
def _matmul_fn(group_size: int, bits: int) -> Any:
    """``x @ dequantize(w).T`` in float32 with a backward pass that dequantizes again (one per layout)."""

    @mx.custom_function
    def matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
        full = _dequantize(w, scales, biases, group_size, bits)
        return (x.astype(mx.float32) @ full.T).astype(x.dtype)

    @matmul.vjp
    def matmul_vjp(primals: Any, cotangent: Any, output: Any) -> Any:
        x, w, scales, biases = primals
        g = cotangent[0] if isinstance(cotangent, list | tuple) else cotangent
        full = _dequantize(w, scales, biases, group_size, bits)
        gx = (g.astype(mx.float32) @ full).astype(x.dtype)
        return gx, mx.zeros_like(w), mx.zeros_like(scales), mx.zeros_like(biases)

    return matmul


def dequantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                       bits: int) -> mx.array:
    """``mx.quantized_matmul(x, w, scales, biases, transpose=True)`` for affine quantization, via BLAS.

    Args:
        x: [..., in] activations.
        w: packed uint32 codes [out, in * bits / 32].
        scales: [out, in / group_size] scales.
        biases: [out, in / group_size] biases.
        group_size: quantization group size.
        bits: bits per code.
    """
    return _matmul_fn(group_size, bits)(x, w, scales, biases)


class BlasQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose product runs as dequantize + BLAS matmul (same parameters, same state)."""

    def __call__(self, x: mx.array) -> mx.array:
        """x @ W^T (+ bias).

        Args:
            x: [..., in] activations.
        """
        y = dequantized_matmul(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)
        return y + self["bias"] if "bias" in self else y


class BlasQuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose tied-head product (``as_linear``) runs as dequantize + BLAS matmul, and whose
    lookup gives the rows the head multiplies by (``code * scale + bias`` in float32; MLX's own lookup,
    ``mx.dequantize`` with bf16 scales, rounds them to bf16 twice), cast to ``lookup_dtype`` (the engine's compute
    dtype, ``set_lookup_dtype``; default the scales' dtype, as MLX's). A tied weight is then one set of values, the
    one the torch engine and a LoRA trainer compute with (``stoa.weights.planes.dequantize_int8g64``, ``compute``).
    """

    lookup_dtype: mx.Dtype | None = None

    def __call__(self, x: mx.array) -> mx.array:
        """The rows of token ids ``x``.

        Args:
            x: token ids.
        """
        rows = _dequantize(self["weight"][x], self["scales"][x], self["biases"][x], self.group_size, self.bits)
        return rows.astype(self.lookup_dtype or self["scales"].dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        """x @ E^T, the tied output projection.

        Args:
            x: [..., dims] hidden states.
        """
        w, scales, biases = self["weight"], self["scales"], self["biases"]
        return dequantized_matmul(x, w, scales, biases, self.group_size, self.bits)


def wants_blas_qmm() -> bool:
    """True when quantized layers should use :class:`BlasQuantizedLinear`: MLX computes on the CPU and
    ``STOA_MLX_QMM`` is not ``kernel``."""
    if os.environ.get(ENV_QMM, "").strip().lower() == "kernel":
        return False
    return mx.default_device().type == mx.DeviceType.cpu


def set_lookup_dtype(model: nn.Module, dtype: mx.Dtype) -> None:
    """Give every :class:`BlasQuantizedEmbedding` of ``model`` its lookup's output dtype (the engine's compute dtype).

    Args:
        model: an MLX model after :func:`use_blas_for_quantized`.
        dtype: the engine's compute dtype.
    """
    for _, m in model.named_modules():
        if isinstance(m, BlasQuantizedEmbedding):
            m.lookup_dtype = dtype


def use_blas_for_quantized(model: nn.Module) -> int:
    """Switch the model's affine-quantized linears and embeddings to the BLAS path when on the CPU.

    Args:
        model: an MLX model after ``nn.quantize``.

    Returns:
        how many layers were switched (0 on Metal, with ``STOA_MLX_QMM=kernel``, or with nothing quantized).
    """
    if not wants_blas_qmm():
        return 0
    n = 0
    for _, m in model.named_modules():
        if getattr(m, "mode", "affine") != "affine" or "biases" not in m:
            continue
        if type(m) is nn.QuantizedLinear:
            m.__class__ = BlasQuantizedLinear
            n += 1
        elif type(m) is nn.QuantizedEmbedding:
            m.__class__ = BlasQuantizedEmbedding
            n += 1
    return n


def _switch_linear_class() -> type:
    """mlx-lm's ``SwitchLinear`` with a CPU product in float32 (built on first use: mlx-lm loads lazily)."""
    from mlx_lm.models.switch_layers import SwitchLinear

    class Float32SwitchLinear(SwitchLinear):
        """MoE experts whose gathered product runs in float32: MLX's CPU ``gather_mm`` takes float32 only, so a
        bf16 MoE fails on the CPU without this. Every call widens the layer's expert weights (one pass over
        them); bf16 is not the CPU default (fp32 is), so this path serves checks, not throughput."""

        def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
            w = self["weight"].swapaxes(-1, -2).astype(mx.float32)
            y = mx.gather_mm(x.astype(mx.float32), w, rhs_indices=indices, sorted_indices=sorted_indices)
            y = y.astype(x.dtype)
            return y + mx.expand_dims(self["bias"][indices], -2) if "bias" in self else y

    return Float32SwitchLinear


_FLOAT32_SWITCH: list[type] = []


def use_float32_gather(model: nn.Module) -> int:
    """Switch the model's unquantized MoE experts to a float32 product when MLX computes on the CPU and they
    are not float32 already (quantized experts use ``gather_qmm``, which takes any float dtype).

    Returns:
        how many expert layers were switched.
    """
    from mlx_lm.models.switch_layers import SwitchLinear

    if mx.default_device().type != mx.DeviceType.cpu:
        return 0
    if not _FLOAT32_SWITCH:
        _FLOAT32_SWITCH.append(_switch_linear_class())
    n = 0
    for _, m in model.named_modules():
        if type(m) is SwitchLinear and m["weight"].dtype != mx.float32:
            m.__class__ = _FLOAT32_SWITCH[0]
            n += 1
    return n
