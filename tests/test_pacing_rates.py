"""Per-worker pacing: a worker's speed, its share of the want by speed, batches that land inside the window, and
the fleet speed the trainer publishes from untrusted reports (bounded, rejected, capped, flooding counted)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from stoa.bucket import open_bucket
from stoa.layout import presence_key, status_key
from stoa.schemas.control import RunStatus
from stoa.trainer.demand import StatusPublisher
from stoa.trainer.rates import FleetRates
from stoa.worker.pacing import RunWatch, Verdict
from stoa.worker.rate import MIN_DUTY, MIN_FRACTION, RateMeter, batch_for_rate, duty, rate_share


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def entry(cid: str, worker: str, generate_s: float | None) -> SimpleNamespace:
    timings = {} if generate_s is None else {"generate_s": generate_s}
    return SimpleNamespace(content_id=cid, record=SimpleNamespace(worker_id=worker, timings=timings))


def test_the_rate_is_a_moving_average_of_batches_and_ignores_empty_ones():
    m = RateMeter()
    m.add(4, 0.0)
    m.add(0, 10.0)
    m.add(3, math.nan)
    assert m.rate is None
    m.add(4, 60.0)  # 4 groups a minute
    assert m.rate == pytest.approx(4.0)
    m.add(8, 60.0)
    assert m.rate == pytest.approx(0.3 * 8 + 0.7 * 4)


def test_shares_follow_speed_and_add_up_to_the_want():
    assert rate_share(30, 3, 10.0, 30.0, 0.0) == 10 and rate_share(30, 3, 20.0, 30.0, 0.0) == 20
    assert rate_share(30, 3, 50.0, 30.0, 0.99) == 30  # a fleet rate below this worker's own: the whole want
    # a fleet of 1 fast (10/min), 20 slow (0.5/min), 50 medium (2/min): the draws add up to the want
    rates = [10.0] + [0.5] * 20 + [2.0] * 50
    fleet = sum(rates)
    total = sum(rate_share(100, 71, r, fleet, ((i * 37) % 100) / 100) for i, r in enumerate(rates))
    assert total == pytest.approx(100, abs=8)
    assert rate_share(100, 71, 10.0, fleet, 0.0) >= 8 * rate_share(100, 71, 0.5, fleet, 0.0) + 1


def test_a_forged_huge_fleet_rate_slows_a_worker_but_never_stops_it():
    assert rate_share(1000, 10, 1.0, 1e9, 0.0) == math.floor(1000 * MIN_FRACTION / 10)


def test_a_batch_lands_inside_the_window():
    assert batch_for_rate(16, None, 30.0, 3) == 4 and batch_for_rate(2, None, 30.0, 3) == 1  # a probe first
    assert batch_for_rate(16, 2.0, 0.0, 3) == 16  # no step time known
    # 4 groups/min, 30 s steps, bound 3: the window lasts 120 s, a quarter of it holds 2 groups
    assert batch_for_rate(16, 4.0, 30.0, 3) == 2
    assert batch_for_rate(16, 0.1, 30.0, 3) == 1  # at least one
    assert batch_for_rate(16, 600.0, 30.0, 3) == 16 and batch_for_rate(16, 20.0, 30.0, 3) == 10


def test_the_fleet_rate_sums_reported_speeds_and_counts_unrated_workers_at_the_median():
    clock = Clock()
    r = FleetRates(clock=clock)
    assert r.update([], 3) is None
    got = r.update([entry("a", "w1", 60.0), entry("b", "w2", 30.0), entry("c", "w3", 20.0)], 3)
    assert got == pytest.approx(1 + 2 + 3)
    assert r.update([entry("a", "w1", 60.0)], 5) == pytest.approx(6 + 2 * 2)  # two joining at the median
    clock.t = 10_000.0
    assert r.update([], 0) is None and not r.rates  # forgotten after live_s


@pytest.mark.parametrize("generate_s", [None, 0.0, -3.0, 60.0 / 1e9, 1e12])
def test_an_absurd_reported_speed_is_rejected_and_never_used(generate_s):
    r = FleetRates(clock=Clock())
    got = r.update([entry("a", "w1", 60.0), entry("b", "w2", 60.0), entry("x", "liar", generate_s)], 3)
    assert r.rejected == 1 and "liar" not in r.rates
    assert got == pytest.approx(3.0)  # the liar counts at the median: 1 group/min


def test_a_fast_liar_is_capped_at_max_ratio_times_the_median():
    r = FleetRates(max_ratio=10.0, clock=Clock())
    honest = [entry(f"c{i}", f"w{i}", 60.0) for i in range(4)]
    got = r.update(honest + [entry("x", "liar", 60.0 / 1e4)], 5)  # 1e4 groups/min: believable, but 1e4 medians
    assert r.capped == 1 and got == pytest.approx(4 + 10)


def test_a_flooding_worker_is_counted_as_excess():
    clock = Clock()
    r = FleetRates(clock=clock)
    r.update([entry(f"h{i}", f"w{i}", 60.0) for i in range(4)], 5)
    flood = [entry(f"f{i}", "flood", 60.0) for i in range(40)]  # the same speed, ten times the groups
    r.update(flood, 5)
    assert r.excess >= 20, r.excess  # 40 delivered, 2 x 44 / 5 + 2 allowed
    honest = FleetRates(clock=clock)
    honest.update([entry(f"h{i}-{j}", f"w{i}", 60.0) for i in range(5) for j in range(10 if i == 0 else 8)], 5)
    assert honest.excess == 0


def test_the_status_publishes_the_fleet_rate_and_omits_it_when_unknown(tmp_path):
    bucket, clock = open_bucket(str(tmp_path)), Clock()
    pub = StatusPublisher(bucket, "r", 10.0, clock=lambda: 100.0 + clock.t, mono=clock, groups_per_step=8)
    pub.beat(1, 8, step_s=0.0, kept_from=1, seen=[])
    assert not {"fleet_rate", "use_rate"} & set(json.loads(bucket.get(status_key("r"))))
    pub.beat(2, 8, step_s=4.0, kept_from=1, seen=[entry("a", "w1", 30.0), entry("b", "w2", 60.0)])
    got = RunStatus.parse(bucket.get(status_key("r")))
    assert got.fleet_rate == pytest.approx(3.0) and got.use_rate == pytest.approx(8 * 60 / 4.0)


def counted_watch(bucket, clock, **kw) -> RunWatch:
    bucket.put(status_key("r"), RunStatus("running", 1, 99.0, 99.0, 8, 0.0, 1, 0, None, 0).to_json())
    w = RunWatch(bucket, "r", stale_s=600, min_interval_s=0, clock=clock, worker_id="a", **{"pacing": True, **kw})
    w.check()
    bucket.delete(presence_key("r", "a", 0))
    return w


def put_status(bucket, wanted, workers, fleet_rate, step_s=30.0, beat=100.0, version=2) -> None:
    bucket.put(status_key("r"), RunStatus("running", version, beat, beat, wanted, step_s, 1, 0, None, workers,
                                          fleet_rate).to_json())


def test_the_worker_sizes_its_batch_and_share_from_its_rate(tmp_path):
    bucket, clock = open_bucket(str(tmp_path)), Clock()
    w = counted_watch(bucket, clock, staleness_bound=3)
    put_status(bucket, 40, 4, 8.0)
    assert w.check().action == "sample"
    assert w.wanted() == 10 and w.batch(16) == 4  # no rate yet: the count's share (40 / 4), a probe of 16 / 4
    clock.t += 60.0
    w.spend(4)  # 4 groups in a minute
    assert w.meter.rate == pytest.approx(4.0)
    clock.t += 200.0
    put_status(bucket, 40, 8, 8.0, beat=101.0, version=3)
    w.check()
    assert w.wanted() == 20  # 40 x 4 / 8 (by the count: 40 / 8 = 5)
    assert w.batch(16) == 2  # 4 groups/min x a quarter of a 4 x 30 s window
    off = counted_watch(open_bucket(str(tmp_path / "off")), clock, pacing=False)
    off.meter.add(4, 120.0)
    put_status(off.bucket, 40, 4, 8.0)
    off.check()
    assert off.batch(16) == 10 and off.batch(8) == 8
    regardless = RunWatch(bucket, "r", stale_s=600, min_interval_s=0, clock=clock, pacing=True, backpressure=False)
    regardless.check()
    assert regardless.batch(16) == 16  # backpressure = false samples regardless: no probe, no pace


def test_a_hostile_status_is_skipped_and_counted(tmp_path):
    bucket, clock = open_bucket(str(tmp_path)), Clock()
    w = counted_watch(bucket, clock)
    w.meter.add(4, 120.0)
    d = json.loads(RunStatus("running", 2, 100.0, 100.0, 40, 30.0, 1, 0, None, 4).to_json())
    for bad in (float("nan"), 1e30, "fast"):
        bucket.put(status_key("r"), json.dumps({**d, "fleet_rate": bad}).encode())
        w.check()
    assert w.bad_status == 3 and w.status is None
    put_status(bucket, 40, 4, -5.0, beat=102.0)
    w.check()
    assert w.bad_rates == 1 and w.wanted() == 10  # shared by the count instead


def test_the_duty_paces_a_faster_fleet_to_the_trainer_and_is_bounded():
    assert duty(200.0, 100.0) == pytest.approx(0.5) and duty(50.0, 100.0) == 1.0
    assert duty(None, 100.0) == duty(200.0, None) == duty(-1.0, 100.0) == duty(200.0, 0.0) == 1.0
    assert duty(1e9, 1e-3) == MIN_DUTY  # a forged tiny use_rate slows a worker, never stops it


def test_a_worker_waits_between_batches_when_the_fleet_is_faster_than_the_trainer(tmp_path):
    bucket, clock = open_bucket(str(tmp_path)), Clock()
    w = counted_watch(bucket, clock)
    bucket.put(status_key("r"), RunStatus("running", 2, 100.0, 100.0, 40, 30.0, 1, 0, None, 4, 40.0,
                                          10.0).to_json())  # the fleet samples 4x what the trainer trains
    assert w.check().action == "sample"
    w.batch(8)
    clock.t += 30.0
    w.spend(2)  # 2 groups in 30 s, at a quarter duty: wait 90 s more
    v = w.check()
    assert v.kind == "pacing" and w.pause_s(v, 2.0) == 2.0
    clock.t += 89.0
    v = w.check()
    assert v.kind == "pacing" and w.pause_s(v, 2.0) == pytest.approx(1.0)  # wakes as the pace ends, not at 2 s
    clock.t += 1.0
    assert w.check().action == "sample"
    assert w.pause_s(Verdict("pause", "", "backpressure"), 2.0) == 2.0


class StatusSpy:
    """The trainer's bucket, keeping every status it writes."""

    def __init__(self, inner) -> None:
        self.inner, self.statuses = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put(self, key, data, *a, **kw):
        if key == status_key("r"):
            self.statuses.append(RunStatus.parse(data))
        return self.inner.put(key, data, *a, **kw)


def test_the_trainer_publishes_the_fleet_speed_and_counts_what_it_did_not_trust(tmp_path, stoa_cache):
    """A real trainer (intake and step faked): its status carries the fleet's speed from the pool's records and the
    rate it trains; a record reporting 1e9 groups/min is counted in the run's summary, not trusted."""
    from stoa.trainer.loop import _Trainer
    from tests.test_lifecycle import fake_steps, make_trainer_cfg

    url = str(tmp_path / "b")
    t = _Trainer(make_trainer_cfg(url, steps=2), echo=lambda *_: None)
    fake_steps(t)
    t.pool.entries = {"a": entry("a", "w1", 30.0), "b": entry("b", "w2", 60.0), "x": entry("x", "liar", 6e-8)}  # type: ignore[assignment]
    t.bucket = spy = StatusSpy(t.bucket)  # type: ignore[assignment]
    try:
        summary = t.run()
    finally:
        t.close()
    assert summary["rates_rejected"] == 1 and summary["excess_groups"] == 0
    running = [s for s in spy.statuses if s.fleet_rate is not None]
    assert running and running[-1].fleet_rate == pytest.approx(2 + 1 + 1.5)  # the liar at the median
