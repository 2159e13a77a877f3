"""`stoa bench fleet --churn` without processes: its seeded schedule keeps the fleet around its average size, and its
books, read from a fabricated run directory, sort every group into the right column."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stoa.bench.churn import ratio
from stoa.bench.churnplan import (
    Books,
    Event,
    Mark,
    Schedule,
    bounds,
    join_delays,
    lost_in_flight,
    plan,
    read_landed,
    read_rows,
    restart_gaps,
    tally,
)
from stoa.rollouts.records import RolloutRecord, Sample


def test_the_schedule_is_seeded_and_keeps_the_fleet_inside_its_bounds():
    s = plan(3, 20.0, 150.0, seed=0, restart_at=75.0)
    assert s == plan(3, 20.0, 150.0, seed=0, restart_at=75.0) and s != plan(3, 20.0, 150.0, seed=1)
    assert [e for e in s.events if e.kind == "trainer"] == [Event(75.0, "trainer")]
    live, low, high = set(s.initial), *bounds(3)
    for e in s.events:
        assert 0 < e.t < 150.0
        if e.kind == "join":
            assert e.worker not in live and e.worker not in s.initial
            live.add(e.worker)
        elif e.kind == "leave":
            assert e.worker in live and e.signal in ("KILL", "TERM")
            live.remove(e.worker)
        assert low <= len(live) <= high
    assert [t for t, _ in s.sizes()] == sorted(t for t, _ in s.sizes())


def test_the_schedule_averages_its_size_and_its_mean_gap_over_a_long_run():
    s = plan(4, 20.0, 200_000.0, seed=3)
    gaps = np.diff([0.0] + [e.t for e in s.events])
    assert gaps.mean() == pytest.approx(20.0, rel=0.05)
    assert s.mean_size() == pytest.approx(4.0, abs=0.15)
    assert {e.signal for e in s.events if e.kind == "leave"} == {"KILL", "TERM"}


def test_the_mean_size_is_weighted_by_time():
    s = Schedule(("a", "b"), (Event(10.0, "join", "c"), Event(15.0, "trainer"), Event(30.0, "leave", "a", "KILL"),
                              Event(35.0, "leave", "b", "TERM")), 40.0)
    assert s.sizes() == [(0.0, 2), (10.0, 3), (30.0, 2), (35.0, 1)]
    assert s.mean_size() == pytest.approx((10 * 2 + 20 * 3 + 5 * 2 + 5 * 1) / 40)


def _record(root: Path, worker: str, seq: int, version: int, created_at: float, generate_s: float = 0.5) -> str:
    rec = RolloutRecord(worker, seq, version, "fp", "toy", "train:1", np.array([1, 2], np.int32),
                        [Sample(np.array([3], np.int32), np.array([-1.0], np.float32), 0.0, "length")],
                        timings={"generate_s": generate_s}, created_at=created_at)
    label = f"v{version:08d}/{worker}-{seq:08d}.rec"
    path = root / "runs" / "r" / "rollouts" / label
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(rec.encode())
    return label


def _rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_books_sort_a_fabricated_run_into_trained_pending_stale_and_surplus(tmp_path):
    w = "c00-abcdef"
    early, b, c, d, e, f, g, late = (_record(tmp_path, w, i, v, t) for i, (v, t) in enumerate(
        [(1, 85.0), (2, 105.0), (2, 101.0), (3, 115.0), (2, 108.0), (2, 125.0), (4, 150.0), (5, 205.0)]))
    step = {"train/loss": 0.0}
    _rows(tmp_path / "runs" / "r" / "metrics" / "trainer.jsonl", [
        {"time": 90.0, "version": 2, "rollout/keys": [early], **step},   # before the window: not counted
        {"time": 95.0, "version": 2},                                    # not a step row
        {"time": 110.0, "version": 3, "rollout/keys": [b, c], **step},
        {"time": 120.0, "version": 4, "rollout/keys": [d], **step,       # v2 leaves the window (bound 1)
         "rollout/skipped_uniform": 1, "rollout/rejected/duplicate": 2, "rollout/filtered": 0, "rollout/accepted": 5},
        {"time": 130.0, "version": 5, "rollout/keys": [], **step},
        {"time": 210.0, "version": 6, "rollout/keys": [g], **step}])     # after the stop: not counted
    rows, _ = read_rows(tmp_path, "r")
    books = tally(rows, read_landed(tmp_path, "r"), t0=100.0, t_end=200.0, bound=1, lost=2, mean_workers=2.5)
    # b, c, d trained; e (v2, landed before v4 was published) surplus; f (landed after) stale; g (v4, inside the
    # window at v5) pending; early and late landed outside the window.
    assert books == Books(wall_s=100.0, steps=3, trained=3, sampled=6, pending=1, stale=1, surplus=1, lost=2,
                          mean_workers=2.5, refused=3)
    assert books.sampled == books.trained + books.pending + books.stale + books.surplus
    assert books.wasted == 4 and books.per_min == pytest.approx(1.8)
    assert {e, f, late} <= {x.label for x in read_landed(tmp_path, "r")}


def test_lost_in_flight_counts_the_last_batch_of_workers_killed_while_sampling(tmp_path):
    metrics = tmp_path / "runs" / "r" / "metrics"
    on, off = {"worker/paused": 1}, {"worker/paused": 0}
    _rows(metrics / "worker-c00-abcdef.jsonl", [{"time": 130.0, **on}, {"time": 140.0, **off}, {"time": 165.0}])
    _rows(metrics / "worker-c00-abcdef-1796480169-00000000.jsonl", [{"time": 166.0, "worker/paused": 1}])  # a copy
    _rows(metrics / "worker-c01-123456.jsonl", [{"time": 140.0, **off}, {"time": 150.0, **on}, {"time": 180.0}])
    _rows(metrics / "worker-c02-654321.jsonl", [{"time": 150.0, "worker/paused": 0}])
    for seq, (t, gen) in enumerate([(150.0, 0.5), (151.0, 0.5), (160.0, 0.7), (160.5, 0.7), (161.0, 0.7)]):
        _record(tmp_path, "c00-abcdef", seq, 2, t, gen)
    _record(tmp_path, "c00-abcdef", 5, 2, 175.0, 0.9)  # after its kill: not its last batch
    _, workers = read_rows(tmp_path, "r")
    assert sorted(workers) == ["c00", "c01", "c02"] and len(workers["c00"]) == 3
    kills = [Mark("c00", 170.0), Mark("c01", 170.0), Mark("c02", 170.0), Mark("c03", 170.0)]
    # c00 was sampling after a batch of 3; c01 paused; c02 sampling its first batch (4 in flight); c03 starting.
    assert lost_in_flight(kills, workers, read_landed(tmp_path, "r"), in_flight=4) == 3 + 0 + 4 + 0


def test_join_delays_and_restart_gaps_time_a_joiners_first_record_and_a_restarted_trainers_first_step(tmp_path):
    for seq, (worker, t) in enumerate([("c03-aaaaaa", 130.0), ("c03-aaaaaa", 125.0), ("c04-bbbbbb", 160.0)]):
        _record(tmp_path, worker, seq, 2, t)
    landed = read_landed(tmp_path, "r")
    joins = [Mark("c03", 100.0), Mark("c04", 150.0), Mark("c05", 150.0)]  # c05 uploaded nothing: left out
    assert join_delays(joins, landed) == [25.0, 10.0]
    rows = [{"time": t} for t in (90.0, 140.0, 101.0, 175.0)]
    assert restart_gaps(rows, [100.0, 150.0]) == [1.0, 25.0]


def test_the_ratio_is_per_average_live_worker():
    def books(trained: int, workers: float) -> Books:
        return Books(60.0, 10, trained, trained, 0, 0, 0, 0, workers)

    assert ratio(books(90, 3.0), books(100, 3.0)) == pytest.approx(0.9)
    assert ratio(books(90, 2.5), books(100, 3.0)) == pytest.approx(90 / 2.5 / (100 / 3.0))
    assert ratio(books(90, 3.0), books(0, 3.0)) == 0.0
