"""Planes: bf16 rounding against torch and MLX, int8g64 against mx.quantize / mx.dequantize."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from stoa.weights.planes import (
    BF16_NAN,
    bf16_bits_to_f32,
    dequantize_int8g64,
    f32_to_bf16_bits,
    is_quantized_name,
    quantize_int8g64,
    state_from_f32,
    state_to_f32,
)

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_MLX = importlib.util.find_spec("mlx") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
needs_mlx = pytest.mark.skipif(not HAS_MLX, reason="mlx not importable")


def _f32(bits: list[int] | np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


# fmt: off
SPECIAL_BITS = [
    0x00000000, 0x80000000,  # +-0
    0x7F800000, 0xFF800000,  # +-inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FBFFFFF,  # NaNs (quiet, signalling, negative)
    0x00000001, 0x80000001, 0x007FFFFF, 0x00008000, 0x00018000, 0x00010000,  # f32 subnormals
    0x00400000, 0x00408000, 0x00418000, 0x00800000,  # around the smallest normal
    0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001,  # ties to even (down, up) and near-ties
    0xBF808000, 0xBF818000,  # negative ties
    0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0xFF7FFFFF,  # overflow to inf / stays max
    0x3F800000, 0x3FFFFFFF, 0x477FFFFF,
]
# fmt: on


def _special() -> np.ndarray:
    return _f32(SPECIAL_BITS)


def _random_f32(rng: np.random.Generator, n: int) -> np.ndarray:
    mags = 10.0 ** rng.uniform(-45, 38, n)
    x = (rng.standard_normal(n) * mags).astype(np.float32)
    raw = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([x, raw, _special()])


def _torch_bits(x: np.ndarray) -> np.ndarray:
    import torch

    return torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


@needs_torch
def test_bf16_matches_torch_bit_for_bit() -> None:
    x = _random_f32(np.random.default_rng(0), 200_000)
    ours = f32_to_bf16_bits(x)
    ref = _torch_bits(x)
    nan = np.isnan(x)
    assert np.array_equal(ours[~nan], ref[~nan])
    # Every NaN maps to the canonical 0x7FC0; torch's vectorized CPU kernel writes 0xFFFF (also a NaN).
    assert np.all(ours[nan] == BF16_NAN)
    assert np.all(np.isnan(bf16_bits_to_f32(ref[nan])))


@needs_torch
def test_bf16_scalar_nan_is_torch_scalar_nan() -> None:
    import torch

    scalar = int(torch.tensor(float("nan")).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF
    assert scalar == BF16_NAN == int(f32_to_bf16_bits(np.array([np.nan], np.float32))[0])


@needs_torch
@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.uint32, st.integers(1, 300)))
def test_bf16_any_bit_pattern_matches_torch(bits: np.ndarray) -> None:
    x = bits.view(np.float32)
    ours, ref = f32_to_bf16_bits(x), _torch_bits(x)
    nan = np.isnan(x)
    assert np.array_equal(ours[~nan], ref[~nan])
    assert np.all(ours[nan] == BF16_NAN)


def test_bf16_special_values() -> None:
    got = f32_to_bf16_bits(_special())
    # fmt: off
    expect = {
        0x00000000: 0x0000, 0x80000000: 0x8000, 0x7F800000: 0x7F80, 0xFF800000: 0xFF80,
        0x7F800001: BF16_NAN, 0xFFFFFFFF: BF16_NAN, 0x00000001: 0x0000, 0x80000001: 0x8000,
        0x00018000: 0x0002, 0x00008000: 0x0000, 0x3F808000: 0x3F80, 0x3F818000: 0x3F82,
        0x3F808001: 0x3F81, 0x7F7FFFFF: 0x7F80, 0x7F7F7FFF: 0x7F7F, 0xFF7FFFFF: 0xFF80,
    }
    # fmt: on
    for i, b in enumerate(SPECIAL_BITS):
        if b in expect:
            assert got[i] == expect[b], hex(b)


def test_bf16_round_trip_all_patterns() -> None:
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    f = bf16_bits_to_f32(bits)
    back = f32_to_bf16_bits(f)
    nan = np.isnan(f)
    assert np.array_equal(back[~nan], bits[~nan])
    assert np.all(back[nan] == BF16_NAN)


def test_bf16_keeps_shape_and_chunk_boundaries() -> None:
    x = np.random.default_rng(1).standard_normal((3, 70_001)).astype(np.float32)
    x[2, -1] = np.nan
    out = f32_to_bf16_bits(x)
    assert out.shape == x.shape and out.dtype == np.uint16
    assert out[2, -1] == BF16_NAN
    assert np.array_equal(out.reshape(-1)[:-1], f32_to_bf16_bits(x.reshape(-1)[:-1]))


def test_is_quantized_name() -> None:
    assert is_quantized_name("model.layers.0.mlp.up_proj.weight", (1536, 576))
    assert is_quantized_name("model.embed_tokens.weight", (49152, 576))
    assert not is_quantized_name("model.norm.weight", (576,))
    assert not is_quantized_name("model.layers.0.self_attn.q_proj.bias", (576, 64))
    assert not is_quantized_name("x.weight", (64, 100))


def _cases(rng: np.random.Generator) -> list[np.ndarray]:
    cases = []
    for i in range(60):
        rows, cols = int(rng.integers(1, 12)), 64 * int(rng.integers(1, 6))
        mag = 10.0 ** rng.uniform(-40, 37) if i % 3 == 0 else 10.0 ** rng.uniform(-4, 1)
        w = (rng.standard_normal((rows, cols)) * mag).astype(np.float32)
        kind = i % 8
        if kind == 1:
            w[:, :64] = w[:, :1]  # constant groups
        elif kind == 2:
            w[:] = 0.0
            w[0, 3] = -0.0
        elif kind == 3:
            w = (rng.integers(-4, 5, (rows, cols)) * 0.125).astype(np.float32)  # exact grid, many ties
        elif kind == 4:
            w[:, 7] = 50.0 * mag  # single outlier per row
        elif kind == 5:
            w = np.abs(w)  # one-signed groups
        elif kind == 6:
            w[0, :64] = 3.3e38  # range overflows float32
            w[0, 64:] = np.linspace(-3.3e38, 3.3e38, cols - 64, dtype=np.float32)
        cases.append(w)
    return cases


@pytest.mark.mlx
@needs_mlx
def test_int8g64_matches_mx_quantize() -> None:
    import mlx.core as mx

    for w in _cases(np.random.default_rng(2)):
        a = mx.array(w, dtype=mx.bfloat16)
        q, s, b = mx.quantize(a, group_size=64, bits=8)
        packed, scales, biases = quantize_int8g64(w)
        assert np.array_equal(np.array(q), packed)
        assert np.array_equal(np.array(s.view(mx.uint16)), scales)
        assert np.array_equal(np.array(b.view(mx.uint16)), biases)
        # bf16 bits in gives the same as float32 in
        again = quantize_int8g64(np.array(a.view(mx.uint16)))
        assert all(np.array_equal(x, y) for x, y in zip(again, (packed, scales, biases), strict=True))
        ref = np.array(mx.dequantize(q, s, b, group_size=64, bits=8).astype(mx.float32))
        ours = dequantize_int8g64(packed, scales, biases)
        assert np.array_equal(ref.view(np.uint32), ours.view(np.uint32))
        # compute: what the quantized matmul multiplies by (float32 scales and biases, no rounding to bf16)
        f32 = np.array(mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=64, bits=8))
        got = dequantize_int8g64(packed, scales, biases, compute=True)
        np.testing.assert_allclose(got, f32, rtol=2e-7, atol=0)


@pytest.mark.mlx
@needs_mlx
@settings(max_examples=40, deadline=None)
@given(
    hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 4), st.sampled_from([64, 128])),
        elements=st.floats(-1e6, 1e6, width=32, allow_subnormal=True),
    )
)
def test_int8g64_property_matches_mx(w: np.ndarray) -> None:
    import mlx.core as mx

    q, s, b = mx.quantize(mx.array(w, dtype=mx.bfloat16), group_size=64, bits=8)
    packed, scales, biases = quantize_int8g64(w)
    assert np.array_equal(np.array(q), packed)
    assert np.array_equal(np.array(s.view(mx.uint16)), scales)
    assert np.array_equal(np.array(b.view(mx.uint16)), biases)


@pytest.mark.mlx
@needs_mlx
def test_int4g64_matches_mx_quantize_and_dequantize() -> None:
    import mlx.core as mx

    for w in _cases(np.random.default_rng(5)):
        q, s, b = mx.quantize(mx.array(w, dtype=mx.bfloat16), group_size=64, bits=4)
        packed, scales, biases = quantize_int8g64(w, 4)
        assert packed.shape[-1] * 8 == w.shape[-1]
        assert np.array_equal(np.array(q), packed)
        assert np.array_equal(np.array(s.view(mx.uint16)), scales)
        assert np.array_equal(np.array(b.view(mx.uint16)), biases)
        ref = np.array(mx.dequantize(q, s, b, group_size=64, bits=4).astype(mx.float32))
        ours = dequantize_int8g64(packed, scales, biases, bits=4)
        assert np.array_equal(ref.view(np.uint32), ours.view(np.uint32))
        f32 = np.array(mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=64, bits=4))
        np.testing.assert_allclose(dequantize_int8g64(packed, scales, biases, bits=4, compute=True), f32, rtol=2e-7,
                                   atol=0)


def test_int4g64_refuses_what_does_not_fit() -> None:
    packed, scales, biases = quantize_int8g64(np.ones((2, 128), np.float32), 4)
    with pytest.raises(ValueError, match="bits"):
        quantize_int8g64(np.ones((2, 128), np.float32), 3)
    with pytest.raises(ValueError, match="bits"):
        dequantize_int8g64(packed, scales, biases, bits=2)
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_int8g64(packed, scales, biases, bits=8)  # int4 codes read as int8: half the groups
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_int8g64(packed[:, :-1], scales, biases, bits=4)
    state = state_from_f32({"a.weight": np.ones((2, 128), np.float32)}, "int4g64")
    del state["a.scales"]
    with pytest.raises(ValueError, match="a.scales"):
        state_to_f32(state, "int4g64")


def test_int8g64_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        quantize_int8g64(np.zeros((2, 65), np.float32))
    w = np.zeros((2, 64), np.float32)
    w[1, 1] = np.inf
    with pytest.raises(ValueError):
        quantize_int8g64(w)
    with pytest.raises(TypeError):
        quantize_int8g64(np.zeros((2, 64), np.float64))


def test_state_round_trip_both_planes() -> None:
    rng = np.random.default_rng(3)
    named = {
        "model.embed_tokens.weight": rng.standard_normal((32, 128)).astype(np.float32),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((96, 64)).astype(np.float32) * 0.02,
        "model.layers.0.input_layernorm.weight": np.ones(64, np.float32),
        "model.layers.0.self_attn.q_proj.bias": rng.standard_normal(64).astype(np.float32),
        "odd.weight": rng.standard_normal((8, 10)).astype(np.float32),
    }
    bf = state_from_f32(named, "bf16")
    assert all(v.dtype == np.uint16 for v in bf.values()) and bf.keys() == named.keys()
    back = state_to_f32(bf, "bf16")
    for k, v in named.items():
        assert np.array_equal(back[k], bf16_bits_to_f32(f32_to_bf16_bits(v)))

    q = state_from_f32(named, "int8g64")
    assert q["model.embed_tokens.weight"].dtype == np.uint32
    assert q["model.embed_tokens.weight"].shape == (32, 32)
    assert q["model.embed_tokens.scales"].shape == (32, 2)
    assert q["model.layers.0.mlp.up_proj.biases"].shape == (96, 1)
    assert q["odd.weight"].dtype == np.uint16
    assert q["model.layers.0.input_layernorm.weight"].dtype == np.uint16
    deq = state_to_f32(q, "int8g64")
    assert deq.keys() == named.keys()
    w = named["model.layers.0.mlp.up_proj.weight"]
    assert np.max(np.abs(deq["model.layers.0.mlp.up_proj.weight"] - w)) < np.ptp(w) / 255 + 1e-3


def test_state_from_f32_rejects_colliding_names() -> None:
    with pytest.raises(ValueError):
        state_from_f32({"a.scales": np.zeros((2, 64), np.float32)}, "int8g64")
    with pytest.raises(ValueError):
        state_from_f32({"a.weight": np.zeros((2, 64), np.float32)}, "fp8")


@pytest.mark.mlx
@needs_mlx
def test_int8g64_state_loads_into_mlx_quantized_layers() -> None:
    import mlx.core as mx
    import mlx.nn as nn

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 64)
            self.proj = nn.Linear(64, 128, bias=True)
            self.norm = nn.RMSNorm(128)

    rng = np.random.default_rng(4)
    named = {
        "embed.weight": rng.standard_normal((16, 64)).astype(np.float32),
        "proj.weight": rng.standard_normal((128, 64)).astype(np.float32) * 0.05,
        "proj.bias": rng.standard_normal(128).astype(np.float32),
        "norm.weight": rng.uniform(0.5, 1.5, 128).astype(np.float32),
    }
    state = state_from_f32(named, "int8g64")
    model = Tiny()
    nn.quantize(model, group_size=64, bits=8)
    arrays = []
    for k, v in state.items():
        a = mx.array(v)
        arrays.append((k, a.view(mx.bfloat16) if v.dtype == np.uint16 else a))
    model.load_weights(arrays, strict=True)
    x = mx.array(rng.standard_normal((3, 64)).astype(np.float32)).astype(mx.bfloat16)
    got = np.array(model.proj(x).astype(mx.float32))
    deq = state_to_f32(state, "int8g64")
    ref = np.array(x.astype(mx.float32)) @ deq["proj.weight"].T + deq["proj.bias"]
    assert np.allclose(got, ref, rtol=0.05, atol=0.05)
