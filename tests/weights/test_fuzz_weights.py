"""Fuzzing the weight plane's decoders: patches, anchors, manifests and the pointer are total functions.

Every generated or mutated input either decodes or raises the decoder's documented error (PatchError,
AnchorError, SyncError; all WeightsError); nothing else escapes (no RecursionError, OverflowError,
MemoryError, struct.error, TypeError, ...). A failed in-place apply leaves the state exactly as it was.
The fast tier runs 12,000 mutated inputs plus 450 hypothesis examples; ``-m slow`` runs 40x as
many per seed, for two seeds (960,000).
Counts are printed (``pytest -s``).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from _weights_fuzz import (
    NASTY,
    RUN,
    anchor,
    dumps,
    frame_anchor,
    frame_patch,
    mutate_bytes,
    mutate_json,
    patch,
    refit_manifest,
    split_anchor,
    split_patch,
    states,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoa.weights.anchor import check_manifest, decode_anchor, load_manifest
from stoa.weights.errors import AnchorError, PatchError, SyncError, WeightsError
from stoa.weights.hashing import state_hash
from stoa.weights.planes import State
from stoa.weights.pointer import Pointer
from stoa.weights.pulse import apply_patch, read_patch_header

FAST = {"patch": 6000, "anchor": 4000, "pointer": 2000}
SLOW_FACTOR = 40


def _same(a: State, b: State) -> bool:
    return a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


def _outcome(fn: Callable[[], Any], allowed: type[WeightsError], what: str) -> str:
    """'ok' or the documented error's reason; any other exception fails the test naming the input."""
    try:
        fn()
    except allowed as e:
        return e.reason
    except Exception as e:  # noqa: BLE001 - the point: nothing else may escape
        raise AssertionError(f"{what}: {type(e).__name__}: {str(e)[:200]}") from e
    return "ok"


def _apply_checked(data: bytes, prev: State) -> None:
    """Header read, then in-place apply on a copy: on refusal the copy must be untouched."""
    read_patch_header(data)
    work = {k: v.copy() for k, v in prev.items()}
    try:
        out, info = apply_patch(work, data, run_id=RUN, expected_from_version=4, plane="bf16", inplace=True,
                                threads=1)
    except PatchError:
        assert _same(work, prev), "a refused in-place apply changed the state"
        raise
    assert state_hash(out) == info.state_hash


def fuzz_patches(n: int, seed: int) -> Counter[str]:
    """``n`` mutated patches: raw damage, re-framed header JSON damage, body damage, prefix damage."""
    prev, new = states(seed)
    good = patch(prev, new)
    header, body = split_patch(good)
    hbytes = json.dumps(header).encode()
    rng = random.Random(seed)
    reasons: Counter[str] = Counter()
    for i in range(n):
        kind = i % 5
        if kind == 0:
            data = mutate_bytes(rng, good)
        elif kind in (1, 2):
            data = frame_patch(dumps(mutate_json(rng, header)), body)
        elif kind == 3:
            data = frame_patch(hbytes, mutate_bytes(rng, body))
        else:
            data = frame_patch(mutate_bytes(rng, hbytes), body, version=rng.choice([1, 1, 1, 0, 2, 65535]),
                               flags=rng.choice([0, 0, 0, 1]))
        reasons[_outcome(lambda d=data: _apply_checked(d, prev), PatchError, f"patch mutation {i} seed {seed}")] += 1
    return reasons


def fuzz_anchors(n: int, seed: int) -> Counter[str]:
    """``n`` mutated anchors: raw file damage and header/section damage with the manifest refitted,
    manifest structure damage, manifest byte damage."""
    state = states(seed)[1]
    data, manifest = anchor(state)
    header, section = split_anchor(data)
    mbytes = json.dumps(manifest).encode()
    rng = random.Random(seed)
    reasons: Counter[str] = Counter()
    for i in range(n):
        kind = i % 5
        if kind == 0:
            d = mutate_bytes(rng, data)
            m = refit_manifest(d, manifest)
        elif kind == 1:
            d, m = frame_anchor(dumps(mutate_json(rng, header)), section, manifest)
        elif kind == 2:
            d, m = frame_anchor(json.dumps(header).encode(), mutate_bytes(rng, section), manifest)
        elif kind == 3:
            d, m = data, mutate_json(rng, manifest)
        else:
            d, mb = data, mutate_bytes(rng, mbytes)
            reasons[_outcome(lambda mb=mb, d=d: decode_anchor(d, load_manifest(mb)), AnchorError,
                             f"manifest bytes mutation {i} seed {seed}")] += 1
            continue
        reasons[_outcome(lambda d=d, m=m: decode_anchor(d, m, run_id=RUN, plane="bf16", version=5), AnchorError,
                         f"anchor mutation {i} kind {kind} seed {seed}")] += 1
    return reasons


def fuzz_pointers(n: int, seed: int) -> Counter[str]:
    """``n`` mutated pointers: raw byte damage and structure-aware damage."""
    good = Pointer(RUN, 7, 4, "bf16", "xxh3-128:" + "0" * 32, "2026-01-01T00:00:00.000+00:00")
    raw = good.to_json()
    d = json.loads(raw)
    rng = random.Random(seed)
    reasons: Counter[str] = Counter()
    for i in range(n):
        data = mutate_bytes(rng, raw) if i % 2 else dumps(mutate_json(rng, d))
        reasons[_outcome(lambda b=data: Pointer.from_json(b), SyncError, f"pointer mutation {i} seed {seed}")] += 1
    return reasons


def _report(name: str, reasons: Counter[str]) -> None:
    print(f"\n[fuzz] {name}: {sum(reasons.values())} inputs, outcomes {dict(reasons.most_common())}")


def test_patch_mutations_only_raise_patch_error() -> None:
    reasons = fuzz_patches(FAST["patch"], seed=1)
    _report("patch", reasons)
    assert sum(reasons.values()) == FAST["patch"]
    # the mutations get past the digest into the header reader, the frame decoder and the hash checks
    assert {"checksum", "bad_format", "hash_mismatch", "truncated"} <= set(reasons)


def test_anchor_mutations_only_raise_anchor_error() -> None:
    reasons = fuzz_anchors(FAST["anchor"], seed=2)
    _report("anchor", reasons)
    assert sum(reasons.values()) == FAST["anchor"]
    assert {"bad_format", "hash_mismatch", "tensor_mismatch"} <= set(reasons)


def test_pointer_mutations_only_raise_sync_error() -> None:
    reasons = fuzz_pointers(FAST["pointer"], seed=3)
    _report("pointer", reasons)
    assert sum(reasons.values()) == FAST["pointer"] and reasons["bad_pointer"] > FAST["pointer"] // 2


def test_a_frame_declaring_a_huge_size_is_refused_before_allocating() -> None:
    """Found by the slow fuzzer: zstd allocates a frame's declared content size (MemoryError) before it
    looks at max_output_size; the declared size must equal what the entry needs."""
    prev, new = states(0)
    header, body = split_patch(patch(prev, new))
    first = min((t for t in header["tensors"] if t["length"]), key=lambda t: t["offset"])
    huge = b"\x28\xb5\x2f\xfd\xe0" + (1 << 60).to_bytes(8, "little") + ((4 << 3) | 1).to_bytes(3, "little") + b"abcd"
    grow = len(huge) - first["length"]
    body = body[: first["offset"]] + huge + body[first["offset"] + first["length"] :]
    for t in header["tensors"]:
        if t["offset"] > first["offset"]:
            t["offset"] += grow
    first["length"] = len(huge)
    assert _outcome(lambda: _apply_checked(frame_patch(json.dumps(header).encode(), body), prev), PatchError,
                    "huge frame") == "bad_format"


@pytest.mark.slow
@pytest.mark.parametrize("seed", [11, 12])
def test_many_more_mutations(seed: int) -> None:
    total: Counter[str] = Counter()
    for name, fuzz in (("patch", fuzz_patches), ("anchor", fuzz_anchors), ("pointer", fuzz_pointers)):
        reasons = fuzz(FAST[name] * SLOW_FACTOR, seed)
        _report(f"{name} (slow, seed {seed})", reasons)
        total.update(reasons)
    assert sum(total.values()) == SLOW_FACTOR * sum(FAST.values())


# ------------------------------------------------------------------- property-based (hypothesis)

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.sampled_from(NASTY[:20])
    | st.text(max_size=20) | st.sampled_from(["\ud800", "bf16", RUN, "<u2", "BF16"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
_FAST_SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])


@_FAST_SETTINGS
@given(st.binary(max_size=300))
def test_arbitrary_bytes_are_refused_cleanly(data: bytes) -> None:
    _outcome(lambda: read_patch_header(data), PatchError, "patch bytes")
    _outcome(lambda: load_manifest(data), AnchorError, "manifest bytes")
    _outcome(lambda: Pointer.from_json(data), SyncError, "pointer bytes")
    m = anchor(states(0)[1])[1]
    _outcome(lambda: decode_anchor(data, refit_manifest(data, m)), AnchorError, "anchor bytes")


@_FAST_SETTINGS
@given(_json)
def test_arbitrary_json_values_are_refused_cleanly(value: Any) -> None:
    _outcome(lambda: check_manifest(value), AnchorError, "manifest value")
    text = dumps(value)
    _outcome(lambda: Pointer.from_json(text), SyncError, "pointer value")
    _outcome(lambda: read_patch_header(frame_patch(text, b"")), PatchError, "patch header value")


@_FAST_SETTINGS
@given(st.dictionaries(st.sampled_from(["schema", "run_id", "version", "anchor_version", "plane", "state_hash",
                                        "updated_at", "size", "tensors", "file_hash", "from_version",
                                        "to_version", "codec", "level", "from_state_hash"]), _json))
def test_field_typed_objects_are_refused_cleanly(fields: dict[str, Any]) -> None:
    prev, new = states(0)
    header, body = split_patch(patch(prev, new))
    _outcome(lambda: _apply_checked(frame_patch(dumps({**header, **fields}), body), prev), PatchError, "header")
    data, manifest = anchor(new)
    _outcome(lambda: decode_anchor(data, {**manifest, **fields}), AnchorError, "manifest fields")
    pointer = json.loads(Pointer(RUN, 7, 4, "bf16", "h", "t").to_json())
    _outcome(lambda: Pointer.from_json(dumps({**pointer, **fields})), SyncError, "pointer fields")
