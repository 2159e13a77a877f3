"""Anchors: valid safetensors that MLX and torch load bit for bit, verified against the manifest."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from stoa.weights.anchor import decode_anchor, encode_anchor
from stoa.weights.errors import AnchorError
from stoa.weights.hashing import state_hash
from stoa.weights.planes import State, state_from_f32

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_MLX = importlib.util.find_spec("mlx") is not None


def _named() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "model.embed_tokens.weight": rng.standard_normal((32, 128)).astype(np.float32),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((48, 64)).astype(np.float32) * 0.02,
        "model.layers.0.input_layernorm.weight": np.ones(64, np.float32),
        "model.norm.weight": np.array([np.nan, -0.0, np.inf, 1e-40] * 16, np.float32),
        "empty.bias": np.zeros(0, np.float32),
    }


@pytest.fixture(params=["bf16", "int8g64"])
def anchor(request: pytest.FixtureRequest) -> tuple[State, bytes, dict, str]:
    plane = request.param
    state = state_from_f32(_named(), plane)
    data, manifest = encode_anchor(state, run_id="run-a", version=8, plane=plane)
    return state, data, manifest, plane


def _same(a: State, b: State) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes() for k in a
    )


def test_round_trip(anchor: tuple[State, bytes, dict, str]) -> None:
    state, data, manifest, plane = anchor
    assert manifest["state_hash"] == state_hash(state) and manifest["size"] == len(data)
    json.dumps(manifest)  # serializable
    out = decode_anchor(data, manifest, run_id="run-a", plane=plane, version=8)
    assert _same(out, state)
    assert all(a.flags.writeable for a in out.values())
    views = decode_anchor(bytearray(data), manifest)
    assert _same(views, state) and all(a.flags.writeable for a in views.values())


def test_header_is_aligned_and_typed(anchor: tuple[State, bytes, dict, str]) -> None:
    _, data, _, plane = anchor
    (hlen,) = struct.unpack_from("<Q", data)
    assert (8 + hlen) % 8 == 0
    header = json.loads(data[8 : 8 + hlen])
    assert header["__metadata__"]["stoa.plane"] == plane
    assert header["model.norm.weight"]["dtype"] == "BF16"
    want = "U32" if plane == "int8g64" else "BF16"
    assert header["model.embed_tokens.weight"]["dtype"] == want
    for name, h in header.items():
        if name != "__metadata__":
            assert h["data_offsets"][0] % (4 if h["dtype"] == "U32" else 2) == 0


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_torch_safetensors_loads_same_bits(anchor: tuple[State, bytes, dict, str]) -> None:
    import torch
    from safetensors.torch import load

    state, data, _, _ = anchor
    loaded = load(data)
    assert loaded.keys() == state.keys()
    for k, t in loaded.items():
        if state[k].dtype == np.uint16:
            assert t.dtype == torch.bfloat16
            got = t.view(torch.int16).numpy().view(np.uint16)
        else:
            assert t.dtype == torch.uint32
            got = t.view(torch.int32).numpy().view(np.uint32)
        assert got.shape == state[k].shape and np.array_equal(got, state[k])


@pytest.mark.mlx
@pytest.mark.skipif(not HAS_MLX, reason="mlx not importable")
def test_mlx_load_gives_same_bits(anchor: tuple[State, bytes, dict, str], tmp_path: Path) -> None:
    import mlx.core as mx

    state, data, _, _ = anchor
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    loaded = mx.load(str(path))
    assert isinstance(loaded, dict) and loaded.keys() == state.keys()
    for k, a in loaded.items():
        if state[k].dtype == np.uint16:
            assert a.dtype == mx.bfloat16
            got = np.array(a.view(mx.uint16))
        else:
            assert a.dtype == mx.uint32
            got = np.array(a)
        assert got.shape == state[k].shape and np.array_equal(got, state[k])


def test_corruption_is_detected(anchor: tuple[State, bytes, dict, str]) -> None:
    _, data, manifest, plane = anchor
    bad = bytearray(data)
    bad[-3] ^= 0x01
    with pytest.raises(AnchorError) as ei:
        decode_anchor(bytes(bad), manifest)
    assert ei.value.reason == "hash_mismatch"
    no_file_hash = {k: v for k, v in manifest.items() if k != "file_hash"}
    with pytest.raises(AnchorError) as ei:
        decode_anchor(bytes(bad), no_file_hash)
    assert ei.value.reason == "hash_mismatch"
    with pytest.raises(AnchorError) as ei:
        decode_anchor(data[:-1], manifest)
    assert ei.value.reason == "truncated"
    with pytest.raises(AnchorError) as ei:
        decode_anchor(data, manifest, run_id="other")
    assert ei.value.reason == "wrong_run"
    with pytest.raises(AnchorError) as ei:
        decode_anchor(data, manifest, plane="int8g64" if plane == "bf16" else "bf16")
    assert ei.value.reason == "wrong_plane"
    with pytest.raises(AnchorError) as ei:
        decode_anchor(data, manifest, version=9)
    assert ei.value.reason == "wrong_version"
    with pytest.raises(AnchorError) as ei:
        decode_anchor(data, {k: v for k, v in manifest.items() if k != "tensors"})
    assert ei.value.reason == "bad_format"


def test_rejects_non_bit_dtypes() -> None:
    with pytest.raises(ValueError):
        encode_anchor({"x": np.zeros(4, np.float32)}, run_id="r", version=1, plane="bf16")
