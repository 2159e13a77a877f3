"""Recovering from damaged weights: refusals name the object, the pointer is the last word, a restarted
trainer publishes a fresh anchor, and oversize objects are refused unread."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_weights_store import Spy, _corrupt, _masters, _same

from stoa.bucket import BucketUnreachable, open_bucket
from stoa.layout import anchor_prefix, patch_key, pointer_key
from stoa.weights.errors import SyncError
from stoa.weights.planes import State, state_from_f32
from stoa.weights.publish import WeightPublisher
from stoa.weights.pulse import encode_patch
from stoa.weights.sync import WeightSync

RUN = "run-a"


@pytest.fixture()
def bucket(tmp_path: Path) -> Spy:
    return Spy(open_bucket(str(tmp_path / "bucket")))


@pytest.fixture()
def sts() -> list[State]:
    return [state_from_f32(m, "bf16") for m in _masters(6)]


def test_chain_that_disagrees_with_the_pointer_is_refused(bucket: Spy, sts: list[State]) -> None:
    """Every object verifies on its own, but the chain ends at another state than current.json names."""
    pub = WeightPublisher(bucket, RUN, "bf16", anchor_every=100)
    pub.publish(1, sts[0])
    pub.publish(2, sts[1])
    at2 = WeightSync(bucket, RUN, "bf16")
    assert at2.sync()[0] == 2
    pub.publish(3, sts[2])
    impostor = {k: a.copy() for k, a in sts[2].items()}
    next(iter(impostor.values())).reshape(-1)[:7] ^= np.uint16(0x0101)
    forged = encode_patch(sts[1], impostor, run_id=RUN, from_version=2, to_version=3, plane="bf16", threads=1)
    bucket.inner.put(patch_key(RUN, 3), forged)  # a valid patch v2 -> a state the pointer does not name
    with pytest.raises(SyncError) as ei:
        at2.sync()
    assert ei.value.reason == "verification_failed"
    assert at2.version == 2 and at2.state is not None and _same(at2.state, sts[1])
    assert [(r.key, r.reason, r.plan) for r in at2.refusals] == [
        (pointer_key(RUN), "pointer_mismatch", "patches"), (pointer_key(RUN), "pointer_mismatch", "anchor@v1")]
    fresh = WeightSync(bucket, RUN, "bf16")
    with pytest.raises(SyncError):
        fresh.sync()
    assert fresh.state is None and [r.reason for r in fresh.refusals] == ["pointer_mismatch"]


def test_refusals_name_the_object_and_reason_also_when_a_fallback_works(bucket: Spy, sts: list[State]) -> None:
    pub = WeightPublisher(bucket, RUN, "bf16", anchor_every=4)
    for v in range(1, 4):
        pub.publish(v, sts[v - 1])
    w = WeightSync(bucket, RUN, "bf16")
    w.sync()
    for v in range(4, 7):
        pub.publish(v, sts[v - 1])
    _corrupt(bucket, patch_key(RUN, 4))
    assert w.sync()[0] == 6 and w.metrics["path"] == "anchor"
    assert [(r.key, r.reason, r.plan) for r in w.refusals] == [(patch_key(RUN, 4), "checksum", "patches")]
    assert w.metrics["refusals"] == 1


def test_resume_over_a_corrupt_newest_patch_returns_the_pointer_and_publishes_an_anchor(
    bucket: Spy, sts: list[State]
) -> None:
    pub = WeightPublisher(bucket, RUN, "bf16", anchor_every=100)
    for v in (1, 2, 3):
        pub.publish(v, sts[v - 1])
    worker = WeightSync(bucket, RUN, "bf16")
    assert worker.sync()[0] == 3
    stuck = WeightSync(bucket, RUN, "bf16")
    _corrupt(bucket, patch_key(RUN, 3))
    restarted = WeightPublisher(bucket, RUN, "bf16", anchor_every=100)
    p = restarted.resume()
    assert p is not None and p.version == 3
    assert restarted.resume_error is not None and restarted.resume_error.reason == "verification_failed"
    assert restarted.published_state is None
    assert [(r.key, r.reason) for r in restarted.resume_refusals] == [(patch_key(RUN, 3), "checksum")]
    with pytest.raises(SyncError):
        stuck.sync()
    info = restarted.publish(4, sts[3])  # no verified previous state: a full anchor, no patch
    assert info.bytes_anchor > 0 and info.bytes_patch == 0
    assert bucket.inner.exists(anchor_prefix(RUN, 4) + "manifest.json")
    version, state = stuck.sync()
    assert version == 4 and stuck.metrics["path"] == "anchor" and _same(state, sts[3])
    version, state = worker.sync()
    assert version == 4 and _same(state, sts[3])
    # and the run goes on with patches again
    assert restarted.publish(5, sts[4]).bytes_patch > 0
    assert worker.sync()[0] == 5 and worker.metrics["path"] == "patches"


def test_resume_of_an_intact_run_keeps_the_published_state(bucket: Spy, sts: list[State]) -> None:
    pub = WeightPublisher(bucket, RUN, "bf16", anchor_every=100)
    pub.publish(1, sts[0])
    pub.publish(2, sts[1])
    restarted = WeightPublisher(bucket, RUN, "bf16", anchor_every=100)
    pointer = restarted.resume()
    assert pointer is not None and pointer.version == 2
    published = restarted.published_state
    assert restarted.resume_error is None and published is not None and _same(published, sts[1])
    assert restarted.publish(3, sts[2]).bytes_anchor == 0


def test_resume_during_an_outage_raises_the_bucket_error(bucket: Spy, sts: list[State]) -> None:
    WeightPublisher(bucket, RUN, "bf16").publish(1, sts[0])

    def down() -> None:
        raise BucketUnreachable("network down")

    bucket.faults[("list", "runs/run-a/weights/anchors/")] = down
    with pytest.raises(BucketUnreachable):
        WeightPublisher(bucket, RUN, "bf16").resume()


def test_newest_verified_falls_back_to_the_longest_verified_chain(bucket: Spy, sts: list[State]) -> None:
    pub = WeightPublisher(bucket, RUN, "bf16", anchor_every=100)
    for v in range(1, 6):
        pub.publish(v, sts[v - 1])
    _corrupt(bucket, patch_key(RUN, 4))
    w = WeightSync(bucket, RUN, "bf16")
    version, state = w.newest_verified()
    assert version == 3 and _same(state, sts[2])
    assert (patch_key(RUN, 4), "checksum") in {(r.key, r.reason) for r in w.refusals}
    _corrupt(bucket, anchor_prefix(RUN, 1) + "model.safetensors")
    with pytest.raises(SyncError) as ei:
        WeightSync(bucket, RUN, "bf16").newest_verified()
    assert ei.value.reason == "verification_failed"

    def down() -> None:
        raise BucketUnreachable("network down")

    bucket.faults[("list", "runs/run-a/weights/anchors/")] = down
    with pytest.raises(BucketUnreachable):  # an outage is not damage: the caller retries
        WeightSync(bucket, RUN, "bf16").newest_verified()


def test_oversize_objects_are_refused_unread(bucket: Spy, sts: list[State]) -> None:
    pub = WeightPublisher(bucket, RUN, "bf16", anchor_every=100)
    pub.publish(1, sts[0])
    pub.publish(2, sts[1])
    w = WeightSync(bucket, RUN, "bf16")
    w.sync()
    pub.publish(3, sts[2])
    big = 64 << 20
    bucket.inner.put(patch_key(RUN, 3), b"\0" * big)  # larger than any honest patch for this state
    file_key = anchor_prefix(RUN, 1) + "model.safetensors"
    bucket.inner.put(file_key, bucket.inner.get(file_key) + b"\0")  # listed size disagrees with its manifest
    bucket.calls.clear()
    with pytest.raises(SyncError):
        w.sync()
    assert {(r.key, r.reason) for r in w.refusals} == {(patch_key(RUN, 3), "oversize"), (file_key, "bad_format")}
    fetched = {k for m, k in bucket.calls if m == "get"}
    assert patch_key(RUN, 3) not in fetched and file_key not in fetched


def test_a_pointer_that_keeps_its_version_and_changes_its_hash_is_followed(bucket: Spy, sts: list[State]) -> None:
    """v2 published again from other weights (a trainer restarted from v1's checkpoint after the pointer went
    back): a worker holding the first v2 must see the pointer as new and load the weights it names."""
    pub = WeightPublisher(bucket, RUN, "bf16", anchor_every=100)
    pub.publish(1, sts[0])
    at_v1 = bucket.inner.get(pointer_key(RUN))
    pub.publish(2, sts[1])
    w = WeightSync(bucket, RUN, "bf16")
    assert w.sync()[0] == 2 and w.poll() is None
    first_hash = w.state_hash
    bucket.inner.put(pointer_key(RUN), at_v1)
    bucket.inner.delete(patch_key(RUN, 2))
    WeightPublisher(bucket, RUN, "bf16", anchor_every=100).publish(2, sts[2])  # a fresh process: an anchor
    p = w.poll()
    assert p is not None and p.version == 2 and p.state_hash != first_hash
    version, state = w.sync(p)
    assert version == 2 and w.metrics["path"] == "anchor" and _same(state, sts[2])
    assert w.state_hash == p.state_hash and w.poll() is None
    assert w.sync()[0] == 2 and w.metrics["path"] == "current"
