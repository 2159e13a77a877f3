"""Quantized layers on the MLX CPU device run as dequantize + BLAS: same outputs and gradients as MLX's
kernel."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from stoa.engines.mlx.quantized import (
    BlasQuantizedEmbedding,
    BlasQuantizedLinear,
    set_lookup_dtype,
    use_blas_for_quantized,
)


def _kernel(x, layer):
    return mx.quantized_matmul(x, layer["weight"], layer["scales"], layer["biases"], transpose=True,
                               group_size=layer.group_size, bits=layer.bits)


@pytest.mark.parametrize("bits", [4, 8])
def test_linear_forward_and_input_gradient_match_the_kernel(bits):
    mx.random.seed(0)
    layer = nn.QuantizedLinear.from_linear(nn.Linear(128, 64, bias=True), group_size=64, bits=bits)
    x = mx.random.normal((3, 5, 128))
    want_y = layer(x)
    want_g = mx.grad(lambda v: (layer(v) ** 2).sum())(x)
    assert use_blas_for_quantized(nn.Sequential(layer)) == 1
    assert type(layer) is BlasQuantizedLinear
    np.testing.assert_allclose(np.array(layer(x)), np.array(want_y), atol=1e-5)
    got_g = mx.grad(lambda v: (layer(v) ** 2).sum())(x)
    np.testing.assert_allclose(np.array(got_g), np.array(want_g), atol=1e-4)


def test_bf16_scales_are_widened_not_rounded_again():
    layer = nn.QuantizedLinear.from_linear(nn.Linear(128, 32, bias=False), group_size=64, bits=8)
    layer.set_dtype(mx.bfloat16)  # a bf16 plane's scales and biases
    x = mx.random.normal((4, 128))
    want = _kernel(x, layer)
    use_blas_for_quantized(nn.Sequential(layer))
    np.testing.assert_allclose(np.array(layer(x)), np.array(want), atol=1e-5)


def test_tied_embedding_head_matches_the_kernel():
    emb = nn.QuantizedEmbedding.from_embedding(nn.Embedding(96, 64), group_size=64, bits=8)
    h = mx.random.normal((2, 64))
    want = emb.as_linear(h)
    use_blas_for_quantized(nn.Sequential(emb))
    assert type(emb) is BlasQuantizedEmbedding
    np.testing.assert_allclose(np.array(emb.as_linear(h)), np.array(want), atol=1e-5)


def test_embedding_rows_are_the_heads_values_in_the_lookup_dtype():
    emb = nn.QuantizedEmbedding.from_embedding(nn.Embedding(96, 64), group_size=64, bits=8)
    emb.set_dtype(mx.bfloat16)  # a published plane's bf16 scales and biases
    ids = mx.array([3, 7, 95])
    assert emb(ids).dtype == mx.bfloat16  # MLX's lookup: bf16 values
    use_blas_for_quantized(nn.Sequential(emb))
    assert emb(ids).dtype == mx.bfloat16  # unchanged until the engine names its dtype
    set_lookup_dtype(nn.Sequential(emb), mx.float32)
    want = mx.dequantize(emb["weight"], emb["scales"].astype(mx.float32), emb["biases"].astype(mx.float32),
                         group_size=64, bits=8)[ids]  # the rows the tied head multiplies by
    got = emb(ids)
    assert got.dtype == mx.float32 and np.array_equal(np.array(got), np.array(want))


def test_opt_out_keeps_the_kernel(monkeypatch):
    monkeypatch.setenv("STOA_MLX_QMM", "kernel")
    layer = nn.QuantizedLinear.from_linear(nn.Linear(64, 64), group_size=64, bits=4)
    assert use_blas_for_quantized(nn.Sequential(layer)) == 0
    assert type(layer) is nn.QuantizedLinear
