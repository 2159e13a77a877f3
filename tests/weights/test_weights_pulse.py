"""PULSE patches: exact round trips, and every kind of damage is caught before weights change."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoa.weights.errors import PatchError
from stoa.weights.hashing import state_hash
from stoa.weights.planes import State, state_from_f32
from stoa.weights.pulse import (
    MAGIC,
    PatchInfo,
    apply_patch,
    changed_positions,
    encode_patch,
    read_patch_header,
)

SPECIAL_U16 = np.array([0x7FC0, 0xFFFF, 0x7F80, 0xFF80, 0x8000, 0x0000, 0x0001, 0x7F81], np.uint16)
SPECIAL_U32 = np.array([0x7FC00000, 0xFFFFFFFF, 0x7F800000, 0x80000000, 0, 1], np.uint32)


def _enc(prev: State, new: State, **kw: object) -> bytes:
    args: dict = {"run_id": "run-a", "from_version": 4, "to_version": 5, "plane": "bf16"} | kw
    return encode_patch(prev, new, **args)


def _apply(state: State, patch: bytes, **kw: object) -> tuple[State, PatchInfo]:
    args: dict = {"run_id": "run-a", "expected_from_version": 4, "plane": "bf16"} | kw
    return apply_patch(state, patch, **args)


def _same(a: State, b: State) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes() for k in a
    )


@st.composite
def state_pairs(draw: st.DrawFn) -> tuple[State, State]:
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    n_tensors = draw(st.integers(1, 4))
    prev: State = {}
    new: State = {}
    for i in range(n_tensors):
        dtype = draw(st.sampled_from([np.uint16, np.uint32]))
        shape = draw(st.sampled_from([(0,), (1,), (7,), (3, 5), (64, 33), (2, 3, 4), (5000,)]))
        info = np.iinfo(dtype)
        a = rng.integers(0, int(info.max) + 1, shape, dtype=np.uint64).astype(dtype)
        special = SPECIAL_U16 if dtype == np.uint16 else SPECIAL_U32
        flat = a.reshape(-1)
        if flat.size:
            flat[rng.integers(0, flat.size, min(flat.size, 4))] = rng.choice(special, min(flat.size, 4))
        b = a.copy()
        fb = b.reshape(-1)
        mode = draw(st.sampled_from(["none", "sparse", "clustered", "dense", "all", "specials"]))
        if fb.size and mode != "none":
            if mode == "sparse":
                idx = rng.choice(fb.size, max(1, fb.size // 100), replace=False)
            elif mode == "clustered":
                start = int(rng.integers(0, fb.size))
                idx = np.arange(start, min(fb.size, start + 40))
            elif mode == "dense":
                idx = np.flatnonzero(rng.random(fb.size) < 0.5)
            elif mode == "all":
                idx = np.arange(fb.size)
            else:
                idx = rng.choice(fb.size, min(fb.size, len(special)), replace=False)
            if mode == "specials":
                fb[idx] = special[: idx.size]
            else:
                fb[idx] = rng.integers(0, int(info.max) + 1, idx.size, dtype=np.uint64).astype(dtype)
        prev[f"t{i}.weight"] = a
        new[f"t{i}.weight"] = b
    return prev, new


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state_pairs(), st.sampled_from(["bf16", "int8g64"]), st.booleans(), st.sampled_from([1, 2]))
def test_round_trip_is_bit_exact(pair: tuple[State, State], plane: str, inplace: bool, threads: int) -> None:
    prev, new = pair
    before = {k: v.copy() for k, v in prev.items()}
    patch = _enc(prev, new, plane=plane, threads=threads)
    work = {k: v.copy() for k, v in prev.items()} if inplace else prev
    out, info = _apply(work, patch, plane=plane, inplace=inplace, threads=threads)
    assert _same(out, new)
    assert info.state_hash == state_hash(new) and info.from_state_hash == state_hash(prev)
    expected_changed = sum(int(np.count_nonzero(prev[k] != new[k])) for k in prev)
    assert info.changed == expected_changed
    assert _same(prev, before)  # the input is never touched in copy mode
    if inplace:
        assert all(out[k] is work[k] for k in work)


def test_nan_and_signed_zero_bits_count_as_changes() -> None:
    a = np.array([0x7FC0, 0x0000, 0x7F80, 0x1234], np.uint16)
    b = np.array([0xFFFF, 0x8000, 0x7F80, 0x1234], np.uint16)
    assert changed_positions(a, b).tolist() == [0, 1]
    out, _ = _apply({"x": a}, _enc({"x": a}, {"x": b}))
    assert out["x"].tolist() == b.tolist()


def test_empty_diff() -> None:
    s = {"a": np.arange(100, dtype=np.uint16), "b": np.zeros((0, 3), np.uint32)}
    patch = _enc(s, {k: v.copy() for k, v in s.items()})
    out, info = _apply(s, patch)
    assert info.changed == 0 and _same(out, s)
    assert read_patch_header(patch).to_version == 5


def test_real_planes_round_trip() -> None:
    rng = np.random.default_rng(0)
    named = {
        "m.embed.weight": rng.standard_normal((64, 128)).astype(np.float32) * 0.02,
        "m.up.weight": rng.standard_normal((96, 64)).astype(np.float32) * 0.02,
        "m.norm.weight": np.ones(64, np.float32),
    }
    stepped = {
        k: v + np.float32(1e-4) * rng.standard_normal(v.shape).astype(np.float32) for k, v in named.items()
    }
    for plane in ("bf16", "int8g64"):
        prev, new = state_from_f32(named, plane), state_from_f32(stepped, plane)
        patch = _enc(prev, new, plane=plane)
        out, info = _apply(prev, patch, plane=plane)
        assert _same(out, new) and 0 < info.changed < info.elements


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from(["bf16", "int8g64"]),
    st.sampled_from([0.0, 1e-7, 1e-5, 1e-2]),
    st.integers(1, 4),
)
def test_real_plane_states_round_trip(seed: int, plane: str, step: float, rows: int) -> None:
    rng = np.random.default_rng(seed)
    named = {
        "m.proj.weight": rng.standard_normal((rows, 128)).astype(np.float32) * 0.02,
        "m.norm.weight": rng.standard_normal(64).astype(np.float32),
    }
    named["m.norm.weight"][:4] = [np.nan, np.inf, -np.inf, -0.0]
    stepped = {
        k: v + np.float32(step) * rng.standard_normal(v.shape).astype(np.float32) for k, v in named.items()
    }
    stepped["m.norm.weight"][:4] = [np.nan, -np.inf, 0.0, 0.0]  # inf sign flip, -inf -> 0.0, -0.0 -> 0.0
    prev, new = state_from_f32(named, plane), state_from_f32(stepped, plane)
    out, info = _apply(prev, _enc(prev, new, plane=plane), plane=plane)
    assert _same(out, new) and info.state_hash == state_hash(new)


@pytest.fixture()
def pair() -> tuple[State, State, bytes]:
    rng = np.random.default_rng(7)
    prev = {
        "a.weight": rng.integers(0, 2**16, (40, 64), dtype=np.uint64).astype(np.uint16),
        "b.weight": rng.integers(0, 2**32, 300, dtype=np.uint64).astype(np.uint32),
    }
    new = {k: v.copy() for k, v in prev.items()}
    new["a.weight"][3, 5:20] ^= 1
    new["b.weight"][::37] += 1
    return prev, new, _enc(prev, new)


def _assert_rejected(state: State, patch: bytes, reasons: set[str], **kw: object) -> str:
    before = {k: v.copy() for k, v in state.items()}
    for inplace in (False, True):
        with pytest.raises(PatchError) as ei:
            _apply(state, patch, inplace=inplace, **kw)
        assert ei.value.reason in reasons, (ei.value.reason, str(ei.value))
        assert _same(state, before)
    return ei.value.reason


def test_every_flipped_byte_is_caught(pair: tuple[State, State, bytes]) -> None:
    prev, _, patch = pair
    seen = set()
    for i in range(len(patch)):
        bad = bytearray(patch)
        bad[i] ^= 0x5A
        seen.add(_assert_rejected(prev, bytes(bad), {"bad_magic", "bad_format", "truncated", "checksum"}))
    assert {"bad_magic", "checksum"} <= seen


def test_every_truncation_is_caught(pair: tuple[State, State, bytes]) -> None:
    prev, _, patch = pair
    for n in range(len(patch)):
        _assert_rejected(prev, patch[:n], {"truncated"})
    _assert_rejected(prev, patch + b"\0", {"bad_format"})


def test_wrong_format_version(pair: tuple[State, State, bytes]) -> None:
    prev, _, patch = pair
    bad = patch[:8] + struct.pack("<H", 2) + patch[10:]
    _assert_rejected(prev, bad, {"bad_format"})
    _assert_rejected(prev, b"PK\x03\x04" + patch[4:], {"bad_magic"})
    assert patch.startswith(MAGIC)


def test_wrong_run_plane_version(pair: tuple[State, State, bytes]) -> None:
    prev, new, patch = pair
    _assert_rejected(prev, patch, {"wrong_run"}, run_id="run-b")
    _assert_rejected(prev, patch, {"wrong_plane"}, plane="int8g64")
    _assert_rejected(prev, patch, {"wrong_from_version"}, expected_from_version=5)  # replayed
    _assert_rejected(prev, patch, {"wrong_from_version"}, expected_from_version=3)  # reordered
    later = _enc(new, prev, from_version=5, to_version=6)
    _assert_rejected(prev, later, {"wrong_from_version"})


def test_tensor_set_and_shape_mismatch(pair: tuple[State, State, bytes]) -> None:
    prev, _, patch = pair
    _assert_rejected({"a.weight": prev["a.weight"]}, patch, {"tensor_mismatch"})
    reshaped = {"a.weight": prev["a.weight"].reshape(64, 40), "b.weight": prev["b.weight"]}
    _assert_rejected(reshaped, patch, {"tensor_mismatch"})
    retyped = {"a.weight": prev["a.weight"], "b.weight": prev["b.weight"].view(np.uint16)[:300]}
    _assert_rejected(retyped, patch, {"tensor_mismatch"})


def test_wrong_base_is_caught_and_rolled_back(pair: tuple[State, State, bytes]) -> None:
    prev, _, patch = pair
    drifted = {k: v.copy() for k, v in prev.items()}
    drifted["a.weight"][0, 0] ^= 0x8000
    _assert_rejected(drifted, patch, {"hash_mismatch"})
    _assert_rejected(drifted, patch, {"base_mismatch"}, expected_from_hash=state_hash(drifted))
    out, _ = _apply(prev, patch, expected_from_hash=state_hash(prev))
    assert state_hash(out) == read_patch_header(patch).state_hash


def test_encode_rejects_layout_changes() -> None:
    a = {"x": np.zeros(4, np.uint16)}
    with pytest.raises(ValueError):
        _enc(a, {"x": np.zeros(5, np.uint16)})
    with pytest.raises(ValueError):
        _enc(a, {"y": np.zeros(4, np.uint16)})
    with pytest.raises(ValueError):
        _enc(a, a, from_version=5, to_version=5)
