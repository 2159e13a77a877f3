"""The torch 4-bit base equals MLX's nn.quantize bit for bit; both backends score the same model alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stoa.algorithms import get_algorithm
from stoa.algorithms.batch import micro_batches
from stoa.local.loop import make_backend
from stoa.models.quant_torch import (
    QuantLinear,
    dequantize_affine,
    pack_nibbles,
    quantize_affine,
    unpack_nibbles,
)
from tests.local.conftest import sample_batch


def test_nibble_packing_and_packed_linear_match_dequantized():
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 24)
    codes, _, _ = quantize_affine(lin.weight, 4, 64)
    assert int(codes.max()) <= 15
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)
    dense, packed = QuantLinear(lin, 4, 64, packed=False), QuantLinear(lin, 4, 64, packed=True)
    assert packed.codes.numel() == 128 * 24 // 2 and not hasattr(packed, "weight")
    x = torch.randn(3, 5, 128, requires_grad=True)
    y1 = dense(x)
    y1.sum().backward()
    g1 = x.grad.clone()
    x.grad = None
    y2 = packed(x)
    y2.sum().backward()
    assert torch.equal(y1, y2) and torch.equal(g1, x.grad)
    assert (dense.weight - lin.weight).abs().max() < 0.1  # 4-bit error, not garbage


@pytest.mark.mlx
@pytest.mark.parametrize(("bits", "group"), [(4, 64), (4, 32), (8, 64), (4, 128)])
def test_quantization_matches_mlx_bit_for_bit(bits, group):
    mx = pytest.importorskip("mlx.core", reason="needs mlx (mlx[cpu] on Linux)")
    w = np.random.default_rng(bits + group).standard_normal((48, 256)).astype(np.float32)
    w[3, :group] = 0.0  # a flat group (scale floor)
    w[5, :group] = -np.abs(w[5, :group])  # all negative: the min edge
    q, s, b = mx.quantize(mx.array(w), group_size=group, bits=bits)
    ref = np.array(mx.dequantize(q, s, b, group_size=group, bits=bits))
    codes, scales, biases = quantize_affine(torch.from_numpy(w), bits, group)
    np.testing.assert_array_equal(scales.numpy(), np.array(s))
    np.testing.assert_array_equal(biases.numpy(), np.array(b))
    np.testing.assert_array_equal(dequantize_affine(codes, scales, biases).numpy(), ref)


@pytest.mark.mlx
def test_torch_and_mlx_score_the_same_qlora_model_alike(make_cfg, tiny_dir):
    """Same 4-bit base (identical quantizer), same adapters (mlx-lm names and layout): logprobs agree in fp32."""
    pytest.importorskip("mlx.core", reason="needs mlx (mlx[cpu] on Linux)")
    t = make_backend(make_cfg(backend="torch", kl_beta=0.0, lr=5e-2), tiny_dir)
    m = make_backend(make_cfg(backend="mlx", dtype="float32"), tiny_dir)
    algo = get_algorithm(make_cfg(kl_beta=0.0).algo_config(), "torch")
    batch = sample_batch(t, algo)
    micro = micro_batches(len(batch), 0)
    batch.old_logp = t.logprobs(batch, micro)
    t.step(batch, micro, algo)  # non-trivial adapters
    m.load_adapter_arrays(t.adapter_arrays())
    lt, lm = t.logprobs(batch, micro), m.logprobs(batch, micro)
    assert np.abs(lt - lm).max() < 1e-4, np.abs(lt - lm).max()
    np.testing.assert_allclose(m.ref_logprobs(batch, micro), t.ref_logprobs(batch, micro), atol=1e-4)
