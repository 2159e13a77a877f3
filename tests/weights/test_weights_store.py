"""Publisher and sync over a local bucket: anchors, patches, fallbacks, retention and races."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoa.bucket import Bucket, BucketUnreachable, ObjectInfo, ObjectNotFound, open_bucket
from stoa.layout import anchor_prefix, patch_key, pointer_key, weights_prefix
from stoa.weights.errors import SyncError, WeightsError
from stoa.weights.hashing import state_hash
from stoa.weights.planes import State, state_from_f32
from stoa.weights.pointer import Pointer
from stoa.weights.publish import WeightPublisher
from stoa.weights.sync import WeightSync

RUN = "run-a"


def _masters(n_versions: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """fp32 master weights for versions 1..n: small Adam-like steps, a few % of bf16 values change."""
    rng = np.random.default_rng(seed)
    w = {
        "model.embed_tokens.weight": rng.standard_normal((256, 128)).astype(np.float32) * 0.02,
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((256, 128)).astype(np.float32) * 0.02,
        "model.layers.0.input_layernorm.weight": np.ones(128, np.float32),
    }
    out = []
    for _ in range(n_versions):
        out.append({k: v.copy() for k, v in w.items()})
        w = {k: v + np.float32(2e-6) * rng.standard_normal(v.shape).astype(np.float32) for k, v in w.items()}
    return out


class Spy:
    """Bucket wrapper that counts calls and can inject faults per method and key."""

    def __init__(self, inner: Bucket) -> None:
        self.inner = inner
        self.url = inner.url
        self.calls: list[tuple[str, str]] = []
        self.faults: dict[tuple[str, str], Callable[[], Any]] = {}

    def _hook(self, method: str, key: str) -> None:
        self.calls.append((method, key))
        fault = self.faults.pop((method, key), None)
        if fault is not None:
            fault()

    def put_create(self, key: str, data: bytes) -> None:
        self._hook("put_create", key)
        self.inner.put_create(key, data)

    def put(self, key: str, data: bytes) -> None:
        self._hook("put", key)
        self.inner.put(key, data)

    def get(self, key: str) -> bytes:
        self._hook("get", key)
        return self.inner.get(key)

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        self._hook("get_with_etag", key)
        return self.inner.get_with_etag(key)

    def get_if_changed(self, key: str, etag: str | None) -> tuple[bytes, str] | None:
        self._hook("get_if_changed", key)
        return self.inner.get_if_changed(key, etag)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self.inner.get_range(key, start, end)

    def cas(self, key: str, data: bytes, expected_etag: str | None) -> str:
        self._hook("cas", key)
        return self.inner.cas(key, data, expected_etag)

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectInfo]:
        self._hook("list", prefix)
        return self.inner.list(prefix, start_after)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def delete(self, key: str) -> None:
        self._hook("delete", key)
        self.inner.delete(key)

    def delete_prefix(self, prefix: str) -> int:
        return self.inner.delete_prefix(prefix)

    def put_file(self, key: str, path: Any, *, create_only: bool = True) -> None:
        self.inner.put_file(key, path, create_only=create_only)

    def get_file(self, key: str, path: Any) -> None:
        self.inner.get_file(key, path)


@pytest.fixture()
def bucket(tmp_path: Path) -> Spy:
    return Spy(open_bucket(str(tmp_path / "bucket")))


def _publish(pub: WeightPublisher, states: list[State], versions: range) -> None:
    for v in versions:
        pub.publish(v, states[v - 1])


def _keys(bucket: Spy) -> set[str]:
    return {o.key for o in bucket.inner.list(weights_prefix(RUN))}


def _corrupt(bucket: Spy, key: str) -> None:
    data = bytearray(bucket.inner.get(key))
    data[len(data) // 2] ^= 0x10
    bucket.inner.put(key, bytes(data))


def _same(a: State, b: State) -> bool:
    return a.keys() == b.keys() and all(
        a[k].tobytes() == b[k].tobytes() and a[k].shape == b[k].shape for k in a
    )


@pytest.fixture(params=["bf16", "int8g64"])
def states(request: pytest.FixtureRequest) -> tuple[str, list[State]]:
    return request.param, [state_from_f32(m, request.param) for m in _masters(10)]


def test_publish_layout_and_late_joiner(bucket: Spy, states: tuple[str, list[State]]) -> None:
    plane, sts = states
    pub = WeightPublisher(bucket, RUN, plane, anchor_every=4)
    infos = [pub.publish(v, sts[v - 1]) for v in range(1, 7)]
    keys = _keys(bucket)
    for v in (1, 4):
        assert anchor_prefix(RUN, v) + "model.safetensors" in keys
        assert anchor_prefix(RUN, v) + "manifest.json" in keys
    assert {k for k in keys if "/anchors/" in k} == {
        anchor_prefix(RUN, v) + n for v in (1, 4) for n in ("model.safetensors", "manifest.json")
    }
    assert {k for k in keys if "/versions/" in k} == {patch_key(RUN, v) for v in range(2, 7)}
    assert infos[0].bytes_patch == 0 and infos[0].bytes_anchor > 0
    assert infos[1].bytes_patch > 0 and infos[1].bytes_anchor == 0
    assert infos[3].bytes_patch > 0 and infos[3].bytes_anchor > 0
    assert all(i.bytes_patch < i.bytes_anchor / 5 for i in infos if i.bytes_patch and i.bytes_anchor)
    # Anchor objects: safetensors before manifest; the pointer is written last of all.
    writes = [k for m, k in bucket.calls if m in ("put_create", "put", "cas")]
    a4 = anchor_prefix(RUN, 4)
    assert writes.index(a4 + "model.safetensors") < writes.index(a4 + "manifest.json")
    assert writes[-1] == pointer_key(RUN)
    p = Pointer.from_json(bucket.inner.get(pointer_key(RUN)))
    assert (p.version, p.anchor_version, p.plane, p.state_hash) == (6, 4, plane, state_hash(sts[5]))

    late = WeightSync(bucket, RUN, plane)
    version, got = late.sync()
    assert version == 6 and _same(got, sts[5])
    assert late.metrics["path"] == "anchor" and late.metrics["versions_applied"] == 2
    assert late.metrics["bytes"] > 0 and late.metrics["errors"] == [] and late.last_metrics is late.metrics


def test_worker_three_behind_uses_patches(bucket: Spy, states: tuple[str, list[State]]) -> None:
    plane, sts = states
    pub = WeightPublisher(bucket, RUN, plane, anchor_every=4)
    _publish(pub, sts, range(1, 4))
    w = WeightSync(bucket, RUN, plane)
    assert w.sync()[0] == 3
    held = w.state
    assert held is not None
    before = {k: v.copy() for k, v in held.items()}
    _publish(pub, sts, range(4, 7))
    version, got = w.sync()
    assert version == 6 and _same(got, sts[5])
    assert w.metrics["path"] == "patches" and w.metrics["versions_applied"] == 3
    sizes = {o.key: o.size for o in bucket.inner.list(weights_prefix(RUN) + "versions/")}
    assert w.metrics["bytes"] == sum(sizes[patch_key(RUN, v)] for v in (4, 5, 6))
    assert _same(held, before)  # a returned state is never modified by later syncs


def test_corrupt_patch_falls_back_to_anchor(bucket: Spy) -> None:
    sts = [state_from_f32(m, "bf16") for m in _masters(6)]
    pub = WeightPublisher(bucket, RUN, "bf16", anchor_every=4)
    _publish(pub, sts, range(1, 4))
    w = WeightSync(bucket, RUN, "bf16")
    w.sync()
    _publish(pub, sts, range(4, 7))
    _corrupt(bucket, patch_key(RUN, 4))
    version, got = w.sync()
    assert version == 6 and _same(got, sts[5])
    assert w.metrics["path"] == "anchor" and "checksum" in w.metrics["errors"][0]
    assert w.totals["fallbacks"] == 1


def test_everything_broken_keeps_last_verified_state(bucket: Spy) -> None:
    sts = [state_from_f32(m, "bf16") for m in _masters(6)]
    pub = WeightPublisher(bucket, RUN, "bf16", anchor_every=4)
    _publish(pub, sts, range(1, 4))
    w = WeightSync(bucket, RUN, "bf16")
    w.sync()
    _publish(pub, sts, range(4, 7))
    _corrupt(bucket, patch_key(RUN, 6))  # every path to v6 needs this patch
    with pytest.raises(SyncError) as ei:
        w.sync()
    assert ei.value.reason == "verification_failed"
    assert w.version == 3 and w.state is not None and _same(w.state, sts[2])
    assert w.metrics["path"] == "failed" and w.totals["failures"] == 1
    # A corrupt anchor with a good chain behind it: the older anchor is used.
    _corrupt(bucket, anchor_prefix(RUN, 4) + "model.safetensors")
    bucket.inner.put(patch_key(RUN, 6), _reencode(sts[4], sts[5]))
    fresh = WeightSync(bucket, RUN, "bf16")
    assert fresh.sync()[0] == 6 and fresh.state is not None and _same(fresh.state, sts[5])
    assert any("@v4" in e for e in fresh.metrics["errors"])


def _reencode(prev: State, new: State) -> bytes:
    from stoa.weights.pulse import encode_patch

    return encode_patch(prev, new, run_id=RUN, from_version=5, to_version=6, plane="bf16")


def test_pointer_checks(bucket: Spy) -> None:
    sts = [state_from_f32(m, "bf16") for m in _masters(1)]
    with pytest.raises(SyncError) as ei:
        WeightSync(bucket, RUN, "bf16").sync()
    assert ei.value.reason == "no_pointer"
    WeightPublisher(bucket, RUN, "bf16").publish(1, sts[0])
    with pytest.raises(SyncError) as ei:
        WeightSync(bucket, RUN, "int8g64").sync()
    assert ei.value.reason == "wrong_plane"
    bucket.inner.put(pointer_key("other"), bucket.inner.get(pointer_key(RUN)))
    with pytest.raises(SyncError) as ei:
        WeightSync(bucket, "other", "bf16").sync()
    assert ei.value.reason == "wrong_run"
    bucket.inner.put(pointer_key("broken"), b"{not json")
    with pytest.raises(SyncError) as ei:
        WeightSync(bucket, "broken", "bf16").sync()
    assert ei.value.reason == "bad_pointer"


def test_poll_is_conditional(bucket: Spy) -> None:
    sts = [state_from_f32(m, "bf16") for m in _masters(3)]
    w = WeightSync(bucket, RUN, "bf16")
    assert w.poll() is None  # no pointer yet
    pub = WeightPublisher(bucket, RUN, "bf16")
    pub.publish(1, sts[0])
    p = w.poll()
    assert p is not None and p.version == 1
    w.sync(p)
    bucket.calls.clear()
    assert w.poll() is None and w.poll() is None
    assert [m for m, _ in bucket.calls] == ["get_if_changed", "get_if_changed"]
    pub.publish(2, sts[1])
    p2 = w.poll()
    assert p2 is not None and p2.version == 2
    assert w.sync(p2)[0] == 2 and w.metrics["path"] == "patches"
    assert w.sync()[0] == 2 and w.metrics["path"] == "current" and w.metrics["bytes"] == 0
    assert w.poll() is None
    # a failed sync leaves the worker behind: poll keeps reporting the pointer until a sync succeeds
    pub.publish(3, sts[2])
    _corrupt(bucket, patch_key(RUN, 3))
    p3 = w.poll()
    assert p3 is not None and p3.version == 3
    with pytest.raises(SyncError):
        w.sync(p3)
    assert w.poll() == p3 and w.version == 2
    bucket.inner.delete(patch_key(RUN, 3))
    bucket.inner.put(anchor_prefix(RUN, 3) + "model.safetensors", b"")  # no manifest: not an anchor
    with pytest.raises(SyncError) as ei:
        w.sync(p3)
    assert ei.value.reason == "unavailable" and w.version == 2


def test_gc_keeps_what_is_needed(bucket: Spy) -> None:
    sts = [state_from_f32(m, "bf16") for m in _masters(10)]
    pub = WeightPublisher(bucket, RUN, "bf16", anchor_every=4)
    _publish(pub, sts, range(1, 8))
    at7 = WeightSync(bucket, RUN, "bf16")
    at7.sync()
    _publish(pub, sts, range(8, 11))
    info = pub.gc(keep_versions=3)  # current 10, floor 7: keep anchor 4 and everything after it
    assert info.kept_anchor == 4 and info.deleted_anchors == [1] and info.deleted_patches == [2, 3, 4]
    keys = _keys(bucket)
    assert not any(k.startswith(anchor_prefix(RUN, 1)) for k in keys)
    assert {anchor_prefix(RUN, v) + "manifest.json" for v in (4, 8)} <= keys
    assert {patch_key(RUN, v) for v in range(5, 11)} <= keys
    # the manifest goes first, so a half-deleted anchor is never mistaken for a complete one
    deletes = [k for m, k in bucket.calls if m == "delete"]
    assert deletes[0] == anchor_prefix(RUN, 1) + "manifest.json"
    assert at7.sync()[0] == 10 and at7.metrics["path"] == "patches"
    assert WeightSync(bucket, RUN, "bf16").sync()[0] == 10
    assert pub.gc(keep_versions=3).deleted_anchors == []
    assert pub.gc(keep_versions=20).kept_anchor is None


def test_too_stale_worker_goes_through_anchor_after_gc(bucket: Spy) -> None:
    sts = [state_from_f32(m, "bf16") for m in _masters(10)]
    pub = WeightPublisher(bucket, RUN, "bf16", anchor_every=4)
    _publish(pub, sts, range(1, 3))
    w = WeightSync(bucket, RUN, "bf16")
    w.sync()
    _publish(pub, sts, range(3, 11))
    pub.gc(keep_versions=1)  # floor 9: keeps anchor 8, deletes patches up to 8
    assert w.sync()[0] == 10 and w.metrics["path"] == "anchor"
    assert w.state is not None and _same(w.state, sts[9])


def test_object_deleted_mid_sync_rereads_pointer(bucket: Spy) -> None:
    sts = [state_from_f32(m, "bf16") for m in _masters(6)]
    pub = WeightPublisher(bucket, RUN, "bf16", anchor_every=4)
    _publish(pub, sts, range(1, 6))

    def vanish() -> None:
        raise ObjectNotFound("deleted by retention")

    bucket.faults[("get", anchor_prefix(RUN, 4) + "model.safetensors")] = vanish
    bucket.calls.clear()
    w = WeightSync(bucket, RUN, "bf16")
    assert w.sync()[0] == 5 and w.metrics["path"] == "anchor"
    assert any("vanished" in e for e in w.metrics["errors"])
    assert sum(1 for m, k in bucket.calls if m == "get_with_etag" and k == pointer_key(RUN)) == 2


def test_bucket_outage_is_a_retryable_sync_error(bucket: Spy) -> None:
    sts = [state_from_f32(m, "bf16") for m in _masters(2)]
    WeightPublisher(bucket, RUN, "bf16").publish(1, sts[0])

    def down() -> None:
        raise BucketUnreachable("network down")

    bucket.faults[("list", weights_prefix(RUN) + "anchors/")] = down
    w = WeightSync(bucket, RUN, "bf16")
    with pytest.raises(SyncError) as ei:
        w.sync()
    assert ei.value.reason == "unavailable" and w.state is None
    assert w.sync()[0] == 1


def test_publish_retry_after_failed_pointer_write(bucket: Spy) -> None:
    sts = [state_from_f32(m, "bf16") for m in _masters(3)]
    pub = WeightPublisher(bucket, RUN, "bf16", anchor_every=4)
    _publish(pub, sts, range(1, 3))

    def down() -> None:
        raise BucketUnreachable("network down")

    bucket.faults[("cas", pointer_key(RUN))] = down
    with pytest.raises(BucketUnreachable):
        pub.publish(3, sts[2])
    assert Pointer.from_json(bucket.inner.get(pointer_key(RUN))).version == 2
    info = pub.publish(3, sts[2])  # the patch already there has identical bytes: create-only succeeds
    assert info.bytes_patch > 0
    w = WeightSync(bucket, RUN, "bf16")
    assert w.sync()[0] == 3 and w.state is not None and _same(w.state, sts[2])


def test_publisher_conflicts_and_restart(bucket: Spy) -> None:
    sts = [state_from_f32(m, "bf16") for m in _masters(6)]
    a = WeightPublisher(bucket, RUN, "bf16", anchor_every=100)
    a.publish(1, sts[0])
    with pytest.raises(WeightsError) as ei:
        a.publish(1, sts[0])
    assert ei.value.reason == "stale_version"
    b = WeightPublisher(bucket, RUN, "bf16", anchor_every=100)
    b.publish(2, sts[1])  # no state in memory: writes an anchor, no patch
    with pytest.raises(WeightsError) as ei:
        a.publish(3, sts[2])
    assert ei.value.reason == "pointer_conflict"
    # restart: resume loads the published state so the next version is a patch, not an anchor
    c = WeightPublisher(bucket, RUN, "bf16", anchor_every=100)
    p = c.resume()
    assert p is not None and p.version == 2
    info = c.publish(3, sts[2])
    assert info.bytes_patch > 0 and info.bytes_anchor == 0
    w = WeightSync(bucket, RUN, "bf16")
    assert w.sync()[0] == 3 and w.state is not None and _same(w.state, sts[2])
    # a left-over patch above the pointer from a crashed attempt is replaced, not an error
    bucket.inner.put_create(patch_key(RUN, 4), b"junk from a crashed trainer")
    assert c.publish(4, sts[3]).bytes_patch > 0
    assert w.sync()[0] == 4 and w.metrics["path"] == "patches"


def test_pointer_json_round_trip() -> None:
    p = Pointer(RUN, 7, 4, "bf16", "xxh3-128:" + "0" * 32, "2026-01-01T00:00:00.000+00:00")
    assert Pointer.from_json(p.to_json()) == p
    d = json.loads(p.to_json())
    assert set(d) == {"schema", "run_id", "version", "anchor_version", "plane", "state_hash", "updated_at"}
    d["anchor_version"] = 9
    with pytest.raises(SyncError):
        Pointer.from_json(json.dumps(d).encode())
