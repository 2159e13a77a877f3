"""Fuzzing the adapter plane's decoders: mutated adapter patches and anchors (plane ``adapter``) go through the
decoder and then the adapter check a worker runs before adopting a version; mutated ``adapter`` objects go through
the contract's reader. Every input decodes or raises the documented error (PatchError, AnchorError, AdapterError;
the contract's BadBucketObject); nothing else escapes. Counts are printed (``pytest -s``)."""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from _weights_fuzz import (
    NASTY,
    RUN,
    dumps,
    frame_anchor,
    frame_patch,
    mutate_bytes,
    mutate_json,
    refit_manifest,
    split_anchor,
    split_patch,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoa.contract import ContractMismatch, ModelSpec, RunContract, SamplingSpec
from stoa.untrusted import BadBucketObject
from stoa.weights.adapter import AdapterSpec, adapter_state, check_adapter
from stoa.weights.anchor import decode_anchor, encode_anchor
from stoa.weights.errors import AdapterError, AnchorError, PatchError
from stoa.weights.planes import ADAPTER_PLANE, QUANT_BITS, State, state_to_f32
from stoa.weights.pulse import apply_patch, encode_patch

LINEARS = {"m.0.q_proj": (16, 8), "m.0.v_proj": (4, 8)}
SPEC = AdapterSpec("llama:c:t", "xxh3-128:" + "0" * 32, 2, 4.0, ("q_proj", "v_proj"))
N = 3000


def _states(seed: int) -> tuple[State, State]:
    rng = np.random.default_rng(seed)
    f32 = {}
    for path, (o, i) in LINEARS.items():
        f32[f"{path}.lora_A.weight"] = rng.standard_normal((SPEC.rank, i)).astype(np.float32)
        f32[f"{path}.lora_B.weight"] = rng.standard_normal((o, SPEC.rank)).astype(np.float32)
    moved = {k: v + np.float32(0.05) * rng.standard_normal(v.shape).astype(np.float32) for k, v in f32.items()}
    return adapter_state(f32), adapter_state(moved)


def _outcome(fn: Callable[[], Any], allowed: tuple[type[Exception], ...], what: str) -> str:
    try:
        fn()
    except allowed as e:
        return str(getattr(e, "reason", type(e).__name__))
    except Exception as e:  # noqa: BLE001 - the point: nothing else may escape
        raise AssertionError(f"{what}: {type(e).__name__}: {str(e)[:200]}") from e
    return "ok"


def _apply_and_check(data: bytes, prev: State) -> None:
    out, _ = apply_patch(prev, data, run_id=RUN, expected_from_version=4, plane=ADAPTER_PLANE, threads=1)
    check_adapter(out, SPEC, LINEARS)


def _decode_and_check(data: bytes, manifest: Any) -> None:
    check_adapter(decode_anchor(data, manifest, run_id=RUN, plane=ADAPTER_PLANE, version=5), SPEC, LINEARS)


def test_adapter_patch_and_anchor_mutations_only_raise_the_planes_errors() -> None:
    prev, new = _states(1)
    good = encode_patch(prev, new, run_id=RUN, from_version=4, to_version=5, plane=ADAPTER_PLANE, threads=1)
    header, body = split_patch(good)
    data, manifest = encode_anchor(new, run_id=RUN, version=5, plane=ADAPTER_PLANE)
    st_header, section = split_anchor(data)
    rng = random.Random(7)
    reasons: Counter[str] = Counter()
    for i in range(N):
        if i % 2 == 0:
            p = mutate_bytes(rng, good) if i % 4 == 0 else frame_patch(dumps(mutate_json(rng, header)), body)
            reasons[_outcome(lambda p=p: _apply_and_check(p, prev), (PatchError, AdapterError), f"patch {i}")] += 1
        else:
            if i % 4 == 1:
                d = mutate_bytes(rng, data)
                m = refit_manifest(d, manifest)
            else:
                d, m = frame_anchor(dumps(mutate_json(rng, st_header)), section, manifest)
            reasons[_outcome(lambda d=d, m=m: _decode_and_check(d, m), (AnchorError, AdapterError), f"anchor {i}")] += 1
    print(f"\n[fuzz] adapter patches and anchors: {N} inputs, outcomes {dict(reasons.most_common())}")
    assert sum(reasons.values()) == N and {"checksum", "bad_format", "hash_mismatch"} <= set(reasons)


def _contract(adapter: Any) -> bytes:
    c = RunContract(run_id="r", model=ModelSpec("llama", "c", "t", 512), n_samples=2, plane="bf16", task_id="toy",
                    task_spec={}, reward_version="1", sampling=SamplingSpec(), created_at=time.time())
    d = json.loads(replace(c, adapter=SPEC.to_dict()).to_json())
    d["adapter"] = adapter
    return dumps(d)


def test_mutated_adapter_objects_are_refused_by_the_contracts_reader() -> None:
    rng = random.Random(3)
    reasons: Counter[str] = Counter()
    for i in range(N):
        data = _contract(mutate_json(rng, SPEC.to_dict()))
        reasons[_outcome(lambda b=data: RunContract.from_json(b), (BadBucketObject, ContractMismatch),
                         f"contract {i}")] += 1
    print(f"\n[fuzz] contract adapter objects: {N} inputs, outcomes {dict(reasons.most_common())}")
    assert reasons["BadBucketObject"] > N // 2 and reasons["ok"] > 0
    assert RunContract.from_json(_contract(SPEC.to_dict())).adapter_spec == SPEC


_FAST = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
                     | st.sampled_from(NASTY[:20]),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4), max_leaves=20)


@_FAST
@given(st.dictionaries(st.sampled_from(list(SPEC.to_dict()) + ["x"]), _json))
def test_arbitrary_adapter_fields_raise_only_value_error(fields: dict[str, Any]) -> None:
    _outcome(lambda: AdapterSpec.from_dict({**SPEC.to_dict(), **fields}), (ValueError,), "adapter fields")


_ARRAY = st.tuples(st.lists(st.integers(0, 20), max_size=3), st.sampled_from([np.uint16, np.uint32]))


@_FAST
@given(st.fixed_dictionaries({f"{p}.lora_{s}.weight": _ARRAY for p in LINEARS for s in "AB"},
                             optional={"m.0.x.weight": _ARRAY}))
def test_arbitrary_adapter_states_raise_only_adapter_error(shapes: dict[str, tuple[list[int], Any]]) -> None:
    state = {k: np.zeros(tuple(s), dt) for k, (s, dt) in shapes.items()}
    _outcome(lambda: check_adapter(state, SPEC, LINEARS), (AdapterError,), "adapter state")
    del state[next(iter(state))]
    _outcome(lambda: check_adapter(state, SPEC, LINEARS), (AdapterError,), "adapter state, one missing")


@pytest.mark.parametrize("seed", [0])
def test_the_good_inputs_decode(seed: int) -> None:
    prev, new = _states(seed)
    p = encode_patch(prev, new, run_id=RUN, from_version=4, to_version=5, plane=ADAPTER_PLANE, threads=1)
    _apply_and_check(p, prev)
    _decode_and_check(*encode_anchor(new, run_id=RUN, version=5, plane=ADAPTER_PLANE))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plane=st.sampled_from(["int8g64", "int4g64"]), rows=st.integers(0, 4),
       words=st.sampled_from([0, 5, 8, 16, 24, 32]),
       row_shift=st.sampled_from([0, 0, 0, 1]), group_shift=st.sampled_from([0, 0, 0, 1, -1]), wide=st.booleans(),
       compute=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_a_quantized_base_decodes_to_its_shape_or_is_refused(plane: str, rows: int, words: int, row_shift: int,
                                                            group_shift: int, wide: bool, compute: bool, seed: int):
    """A LoRA run's base on a quantized plane (int8g64, int4g64), codes and scales of fitting and unfitting shapes
    and bits, through the anchor and the decoder engines and the trainer use (``state_to_f32(..., compute=...)``):
    the weight comes out as [rows, words * 32 / bits] or the decoder raises ValueError / TypeError (nothing
    else)."""
    rng = np.random.default_rng(seed)
    groups = max(0, words * 32 // QUANT_BITS[plane] // 64 + group_shift)
    side = rng.integers(0, 2**16, (rows + row_shift, groups)).astype(np.uint32 if wide else np.uint16)
    state = {"m.w.weight": rng.integers(0, 2**32, (rows, words), dtype=np.uint32), "m.w.scales": side,
             "m.w.biases": side.copy(), "m.n.weight": rng.integers(0, 2**16, (rows,)).astype(np.uint16)}
    data, manifest = encode_anchor(state, run_id=RUN, version=0, plane=plane)
    decoded = decode_anchor(bytearray(data), manifest, run_id=RUN, plane=plane, version=0)
    try:
        out = state_to_f32(decoded, plane, compute=compute)
    except (ValueError, TypeError):
        return
    assert out.keys() == {"m.w.weight", "m.n.weight"}
    assert out["m.w.weight"].shape == (rows, words * 32 // QUANT_BITS[plane])
