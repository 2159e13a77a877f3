"""Backpressure shared among N workers: the flood through the real pacing code, shares, the live-worker count
(presence objects, records, expiry, planted ids and keys) and the status object parsed as untrusted."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from stoa.bench.flood import FloodSettings, simulate
from stoa.bucket import open_bucket
from stoa.layout import presence_key, presence_prefix, status_key
from stoa.lifecycle import PRESENCE_S
from stoa.schemas.control import MAX_STATUS_BYTES, RunStatus
from stoa.trainer.demand import StatusPublisher
from stoa.trainer.liveness import LiveWorkers
from stoa.worker.pacing import JOIN_WAIT_S, RunWatch, draw, share


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_six_workers_write_at_most_twice_what_the_trainer_consumes(tmp_path):
    f = simulate(FloodSettings(workers=6, steps=6), tmp_path / "shared")
    assert f.consumed == 24 and f.written <= 2 * f.consumed, f
    assert f.peak_objects <= 2 * f.window, f
    old = simulate(FloodSettings(workers=6, steps=6, whole_want=True), tmp_path / "whole")  # the old pacing
    assert old.written > 3 * old.consumed, old


def test_one_worker_keeps_its_pace(tmp_path):
    alone = simulate(FloodSettings(workers=1, steps=6), tmp_path / "shared")
    old = simulate(FloodSettings(workers=1, steps=6, whole_want=True), tmp_path / "whole")
    assert alone.written == old.written and alone.seconds == old.seconds, (alone, old)


def test_shares_add_up_to_the_want_on_average():
    assert [share(10, 4, u) for u in (0.0, 0.49, 0.5, 0.99)] == [3, 3, 2, 2]  # 10 = 2 x 4 + 2: half draw a third
    assert share(7, 1, 0.99) == 7 and share(0, 5, 0.0) == 0
    s = RunStatus("running", 3, 100.0, 100.0, 5, 0.0, 1, 0, None, 20)
    total = sum(share(5, 20, draw(f"w{i}", s, g)) for i in range(20) for g in range(50)) / 50
    assert total == pytest.approx(5, abs=0.5)


def status(wanted=8, workers: int | None = 4, version=3, beat=100.0, state="running") -> bytes:
    return RunStatus(state, version, beat, beat, wanted, 0.0, 1, 0, None, workers).to_json()


def counted(bucket, clock, wanted=8, workers=1) -> RunWatch:
    """A worker that announced itself and was counted (the trainer deleted its presence object)."""
    bucket.put(status_key("r"), status(wanted=wanted, workers=0, beat=99.0))
    w = RunWatch(bucket, "r", stale_s=60, min_interval_s=0, clock=clock, worker_id="a")
    assert w.check().kind == "backpressure" and w.announced == 1
    bucket.delete(presence_key("r", "a", 0))
    bucket.put(status_key("r"), status(wanted=wanted, workers=workers))
    return w


def test_a_worker_samples_its_share_and_a_heartbeat_grants_no_more(tmp_path):
    bucket, clock = open_bucket(str(tmp_path)), Clock()
    w = counted(bucket, clock)
    assert w.check().action == "sample" and w.wanted() == 8 and w.batch(4) == 4  # alone: the whole want
    clock.t = 1.0
    w.spend(8)
    bucket.put(status_key("r"), status(wanted=8, workers=1, beat=101.0))  # a heartbeat: same version and want
    assert w.check().kind == "backpressure" and w.wanted() == 0
    clock.t = 2.5  # more than one batch time (1 s) since the grant: a new version grants anew
    bucket.put(status_key("r"), status(wanted=4, workers=1, version=4, beat=102.0))
    assert w.check().action == "sample" and w.wanted() == 4
    bucket.put(status_key("r"), status(wanted=0, workers=1, version=4, beat=103.0))
    assert w.check().kind == "backpressure"  # a want of zero stops the rest of the share at once


def test_a_lost_grant_is_granted_again_after_two_batch_times(tmp_path):
    bucket, clock = open_bucket(str(tmp_path)), Clock()
    w = counted(bucket, clock, wanted=3)
    assert w.check().action == "sample"
    w.batch(3)
    clock.t = 1.0
    w.spend(3)  # a batch of 1 s; the trainer never got the groups (say they were stale)
    bucket.put(status_key("r"), status(wanted=3, workers=1, beat=101.0))
    clock.t = 1.5
    assert w.check().kind == "backpressure"
    bucket.put(status_key("r"), status(wanted=3, workers=1, beat=102.0))
    clock.t = 2.0  # two batch times since the grant
    assert w.check().action == "sample" and w.wanted() == 3


def test_workers_announce_wait_for_the_first_count_and_fail_open(tmp_path):
    bucket, clock = open_bucket(str(tmp_path)), Clock()
    bucket.put(status_key("r"), status(wanted=8, workers=0))
    w = RunWatch(bucket, "r", stale_s=600, min_interval_s=0, clock=clock, worker_id="a")
    v = w.check()
    assert v.kind == "backpressure" and "not counted" in v.reason
    assert [i.key for i in bucket.list(presence_prefix("r"))] == [presence_key("r", "a", 0)]
    clock.t = JOIN_WAIT_S  # the trainer never counts (a broken listing): sample rather than stall
    assert w.check().action == "sample" and w.wanted() == 8
    assert w.announced == 1  # active since: no second presence object before PRESENCE_S
    clock.t = JOIN_WAIT_S + PRESENCE_S
    w.check()
    assert w.announced == 2


def test_a_newcomer_draws_once_counted_and_the_want_moved(tmp_path):
    bucket, clock = open_bucket(str(tmp_path)), Clock()
    bucket.put(status_key("r"), status(wanted=12, workers=3))  # a busy run: three workers counted
    w = RunWatch(bucket, "r", stale_s=600, min_interval_s=0, clock=clock, worker_id="new")
    assert w.check().kind == "backpressure" and w.wanted() == 0  # a share of 3 would leave it out
    bucket.put(status_key("r"), status(wanted=10, workers=3, beat=101.0))  # the want moved, still uncounted
    assert w.check().kind == "backpressure"
    live = LiveWorkers(bucket, "r", list_every_s=10, clock=clock)
    live._announced.update({"a": 0.0, "b": 0.0, "c": 0.0})
    clock.t = 5.0  # the trainer's next heartbeat lists the presence object and counts it
    pub = StatusPublisher(bucket, "r", 10.0, clock=lambda: 1e9 + clock.t, mono=clock)
    pub.live = live
    assert pub.beat(3, 10, step_s=0, kept_from=1, seen=[])
    assert RunStatus.from_json(bucket.get(status_key("r"))).workers == 4
    assert w.check().kind == "backpressure"  # the 10 were granted to the other three: they may be in flight
    clock.t = 6.5
    assert pub.beat(3, 8, step_s=0, kept_from=1, seen=[])  # 4 landed: what the want says now is news
    assert w.check().action == "sample" and w.wanted() == 2


def test_a_worker_alone_keeps_only_its_share_once_others_are_counted(tmp_path):
    bucket, clock = open_bucket(str(tmp_path)), Clock()
    w = counted(bucket, clock, wanted=8, workers=1)
    assert w.check().action == "sample" and w.wanted() == 8
    bucket.put(status_key("r"), status(wanted=8, workers=4, beat=101.0))  # three more counted, nothing landed
    w.check()
    assert w.wanted() == 2


def test_a_worker_that_may_not_write_presence_still_samples_and_does_not_retry_at_every_check(tmp_path):
    from stoa.bucket import AccessDenied

    class NoPresence:
        def __init__(self, inner):
            self.inner, self.puts = inner, 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def put_create(self, key, data):
            self.puts += 1
            raise AccessDenied(f"injected: {key}")

    bucket, clock = NoPresence(open_bucket(str(tmp_path))), Clock()
    bucket.put(status_key("r"), status(wanted=8, workers=0))
    w = RunWatch(bucket, "r", stale_s=600, min_interval_s=0, clock=clock, worker_id="a")
    for t in range(int(JOIN_WAIT_S)):
        clock.t = float(t)
        assert w.check().kind == "backpressure"
    clock.t = JOIN_WAIT_S
    assert w.check().action == "sample" and bucket.puts == 1 and w.announced == 0


def test_an_older_trainer_status_gives_the_whole_want_and_no_presence(tmp_path):
    bucket = open_bucket(str(tmp_path))
    bucket.put(status_key("r"), status(wanted=5, workers=None))
    w = RunWatch(bucket, "r", stale_s=60, min_interval_s=0, clock=Clock(), worker_id="a")
    assert w.check().action == "sample" and w.wanted() == 5
    assert not list(bucket.list(presence_prefix("r")))


def entry(cid: str, worker: str):
    return SimpleNamespace(content_id=cid, record=SimpleNamespace(worker_id=worker))


def test_the_trainer_counts_records_and_presence_and_forgets_the_silent(tmp_path):
    bucket, clock = open_bucket(str(tmp_path)), Clock()
    live = LiveWorkers(bucket, "r", list_every_s=10, live_s=60, clock=clock)
    assert live.update([]) == 0
    bucket.put_create(presence_key("r", "new-1", 0), b"")
    bucket.put_create(presence_key("r", "w1", 0), b"")
    assert live.update([entry("c1", "w1"), entry("c2", "w2")]) == 3  # w1 on both counts once
    assert not list(bucket.list(presence_prefix("r")))  # what it listed is deleted
    clock.t = 30.0
    assert live.update([entry("c1", "w1"), entry("c3", "w2")]) == 3  # c1 is no news; c3 refreshes w2
    clock.t = 75.0
    assert live.update([entry("c3", "w2")]) == 1  # new-1 and w1 silent for over 60 s: their shares come back


def test_planted_presence_ids_are_capped_and_hostile_keys_counted(tmp_path):
    bucket, clock = open_bucket(str(tmp_path)), Clock()
    live = LiveWorkers(bucket, "r", list_every_s=0, max_joining=8, clock=clock)
    for i in range(40):
        bucket.put_create(presence_key("r", f"ghost{i}", 0), b"")
    planted = ("x", "back\\slash-00000001", "new\nline-00000001", "a" * 200 + "-00000001", "w-1")
    for name in planted:  # written beside the bucket API, as any S3 client could name them
        (tmp_path / presence_prefix("r") / name).write_bytes(b"{" * 10_000)
    assert live.update([entry("c1", "honest")]) == 1 + 8
    assert live.rejected == len(planted)
    assert live.update([entry("c1", "honest")]) == 1 + 8  # keys the bucket cannot delete stay skipped


def test_the_trainer_publishes_the_count_and_rewrites_when_it_rises(tmp_path):
    bucket, clock = open_bucket(str(tmp_path)), Clock()
    pub = StatusPublisher(bucket, "r", 10.0, clock=lambda: 1e9 + clock.t, mono=clock)
    assert pub.beat(1, 8, step_s=0, kept_from=1, seen=[])
    assert RunStatus.from_json(bucket.get(status_key("r"))).workers == 0
    bucket.put_create(presence_key("r", "a", 0), b"")
    clock.t = 0.5
    assert pub.beat(1, 8, step_s=0, kept_from=1, seen=[])  # nobody counted: it lists at every beat
    assert RunStatus.from_json(bucket.get(status_key("r"))).workers == 1
    clock.t = 1.0
    assert not pub.beat(1, 8, step_s=0, kept_from=1, seen=[])  # nothing new
    assert not pub.beat(1, 5, step_s=0, kept_from=1, seen=[])  # the want fell within REWRITE_S of a write
    clock.t = 1.6
    assert pub.beat(1, 5, step_s=0, kept_from=1, seen=[])  # ... and after: workers that drew none draw again
    assert not pub.beat(1, None, step_s=0, kept_from=1, seen=[])  # no want (backpressure off): no count
    assert pub.live.listings == 2  # at 0 and 0.5 (nobody counted)
    clock.t = 3.0
    pub.beat(1, 5, step_s=0, kept_from=1, seen=[])
    clock.t = 6.0
    pub.beat(1, 5, step_s=0, kept_from=1, seen=[])
    assert pub.live.listings == 3  # 0.5 found one: again after a quarter heartbeat (3.0); 3.0 found none: at 10.5


@pytest.mark.parametrize("data", [
    b"[" * 100_000 + b"]" * 100_000,  # deep nesting: refused before parsing
    b'{"state": "running", "version": ' + b"9" * 5000 + b"}",  # a huge integer literal
    b'{"state": "running", "version": 1e400}',
    b"[1, 2]", b"null", b"\xff\xfe{}", b'{"state": "running"}',
])
def test_a_hostile_status_reads_as_absent(data):
    assert RunStatus.from_json(data) is None


def test_status_fields_have_exact_types_and_bounds():
    good = json.loads(status(wanted=3, workers=2))
    assert RunStatus.from_json(json.dumps(good).encode()) == RunStatus("running", 3, 100.0, 100.0, 3, 0.0, 1, 0,
                                                                       None, 2)
    for field, bad in (("workers", True), ("workers", -1), ("workers", 2**40), ("workers", "2"), ("version", 1.0),
                       ("wanted_groups", [3]), ("updated_at", "now"), ("step_s", {"a": 1}), ("state", "done")):
        assert RunStatus.from_json(json.dumps({**good, field: bad}).encode()) is None, (field, bad)
    older = {k: v for k, v in good.items() if k not in ("workers", "step", "target_steps")}
    assert RunStatus.from_json(json.dumps(older).encode()).workers is None
    assert RunStatus.from_json(b" " * (MAX_STATUS_BYTES + 1)) is None
