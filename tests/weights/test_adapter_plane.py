"""The adapter plane (numpy, local bucket): adapter versions sync bit-exact through anchors and PULSE patches; an
adapter of another rank or shape, missing tensors, a corrupt adapter object, a base other than the contract's:
each refused with its named reason while the last good version stays."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stoa.bucket import open_bucket
from stoa.layout import ANCHOR_FILE, base_prefix, patch_key
from stoa.weights.adapter import AdapterSpec, adapter_state, base_problem, check_adapter, fetch_base, publish_base
from stoa.weights.errors import AdapterError, SyncError
from stoa.weights.planes import ADAPTER_PLANE, state_from_f32
from stoa.weights.publish import WeightPublisher
from stoa.weights.sync import WeightSync

RUN = "r"
LINEARS = {"m.layers.0.q_proj": (32, 16), "m.layers.0.v_proj": (8, 16)}
SPEC = AdapterSpec("llama:c:t", "xxh3-128:" + "0" * 32, 4, 8.0, ("q_proj", "v_proj"))


def _adapter(seed: int, rank: int = 4, linears: dict[str, tuple[int, int]] = LINEARS) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for path, (o, i) in linears.items():
        out[f"{path}.lora_A.weight"] = rng.standard_normal((rank, i)).astype(np.float32)
        out[f"{path}.lora_B.weight"] = rng.standard_normal((o, rank)).astype(np.float32) * 0.01
    return out


def _check(state) -> None:
    check_adapter(state, SPEC, LINEARS)


def _setup(tmp_path: Path):
    bucket = open_bucket(str(tmp_path / "b"))
    pub = WeightPublisher(bucket, RUN, ADAPTER_PLANE)
    return bucket, pub, WeightSync(bucket, RUN, ADAPTER_PLANE, check=_check)


def test_adapter_versions_sync_bit_exact_through_anchor_and_patches(tmp_path: Path):
    bucket, pub, sync = _setup(tmp_path)
    f32 = _adapter(0)
    infos = []
    for v in (1, 2, 3):
        f32 = {k: a + np.float32(1e-2) * np.random.default_rng(v).standard_normal(a.shape).astype(np.float32)
               for k, a in f32.items()}
        state = adapter_state({**f32, "m.layers.0.q_proj.weight": np.ones((32, 16), np.float32)})  # base dropped
        infos.append(pub.publish(v, state))
        got_v, got = sync.sync()
        assert got_v == v and got.keys() == state.keys()
        assert all(np.array_equal(got[k], state[k]) and got[k].dtype == np.uint16 for k in state)  # bit-exact
    assert infos[0].bytes_anchor and infos[1].bytes_patch and infos[2].bytes_patch  # anchor, then patches
    assert sync.metrics["path"] == "patches" and "m.layers.0.q_proj.weight" not in got


@pytest.mark.parametrize("bad,reason", [
    (adapter_state(_adapter(1, rank=8)), "wrong_rank"),
    (adapter_state(_adapter(1, linears={**LINEARS, "m.layers.0.v_proj": (8, 24)})), "wrong_shape"),
    (adapter_state({k: v for k, v in _adapter(1).items() if "v_proj" not in k}), "tensor_mismatch"),
])
def test_an_adapter_of_another_rank_or_shape_is_refused_and_the_last_good_version_stays(tmp_path: Path, bad, reason):
    bucket, pub, sync = _setup(tmp_path)
    good = adapter_state(_adapter(0))
    pub.publish(1, good)
    assert sync.sync()[0] == 1
    WeightPublisher(bucket, RUN, ADAPTER_PLANE).publish(2, bad)  # a fresh publisher: an anchor of the bad shape
    with pytest.raises(SyncError):
        sync.sync()
    assert sync.version == 1 and all(np.array_equal(sync.state[k], good[k]) for k in good)  # type: ignore[index]
    assert [r.reason for r in sync.refusals] == [reason]


def test_a_corrupt_adapter_patch_is_refused_and_the_last_good_version_stays(tmp_path: Path):
    bucket, pub, sync = _setup(tmp_path)
    good = adapter_state(_adapter(0))
    pub.publish(1, good)
    sync.sync()
    pub.publish(2, adapter_state(_adapter(5)))
    data = bytearray(bucket.get(patch_key(RUN, 2)))
    data[len(data) // 2] ^= 0x40
    bucket.put(patch_key(RUN, 2), bytes(data))
    with pytest.raises(SyncError):
        sync.sync()
    assert sync.version == 1 and sync.refusals[0].reason == "checksum"


def test_check_adapter_refuses_non_bf16_bits():
    state = adapter_state(_adapter(0))
    state["m.layers.0.q_proj.lora_A.weight"] = state["m.layers.0.q_proj.lora_A.weight"].astype(np.uint32)
    with pytest.raises(AdapterError, match="bad_format"):
        _check(state)


def test_the_base_is_published_once_and_fetched_only_against_the_contracts_hash(tmp_path: Path):
    bucket = open_bucket(str(tmp_path / "b"))
    base = state_from_f32({"w.weight": np.arange(64 * 2, dtype=np.float32).reshape(2, 64)}, "bf16")
    h = publish_base(bucket, RUN, base, "bf16")
    assert publish_base(bucket, RUN, base, "bf16") == h  # a restarted trainer: same base, same hash
    spec = AdapterSpec(SPEC.base, h, 4, 8.0, SPEC.targets)
    got = fetch_base(bucket, RUN, "bf16", spec)
    assert np.array_equal(got["w.weight"], base["w.weight"])
    with pytest.raises(AdapterError, match="wrong_base"):  # another base under the same run
        publish_base(bucket, RUN, {"w.weight": base["w.weight"] + np.uint16(1)}, "bf16")
    with pytest.raises(AdapterError, match="wrong_base"):  # the contract names another base
        fetch_base(bucket, RUN, "bf16", SPEC)
    data = bytearray(bucket.get(base_prefix(RUN) + ANCHOR_FILE))
    data[-1] ^= 1
    bucket.put(base_prefix(RUN) + ANCHOR_FILE, bytes(data))
    with pytest.raises(Exception, match="hash_mismatch"):  # a corrupt base object
        fetch_base(bucket, RUN, "bf16", spec)


def test_a_worker_on_another_base_is_refused_and_the_spec_round_trips():
    assert base_problem(SPEC, "llama:c:t") is None
    assert "this worker's model is 'llama:c:OTHER'" in (base_problem(SPEC, "llama:c:OTHER") or "")
    assert AdapterSpec.from_dict(SPEC.to_dict()) == SPEC
    for bad in ({**SPEC.to_dict(), "rank": 0}, {**SPEC.to_dict(), "x": 1}, {**SPEC.to_dict(), "targets": []}):
        with pytest.raises(ValueError):
            AdapterSpec.from_dict(bad)
