"""Backpressure flood benchmark: N workers against one trainer; how many groups they write per group trained.

Everything that paces the fleet is the real code on a local bucket: each worker reads the run status and
decides through :class:`stoa.worker.pacing.RunWatch` (its share of the want, presence objects, pauses), the trainer
ingests with the real ``RecordPool`` (valid records of the tiny model's codec), publishes ``wanted_groups`` and
the live-worker count with the real ``StatusPublisher`` and deletes old rollouts with ``RolloutRetention``.
Sampling and training are simulated on one clock (a discrete-event simulation, no sleeping): a worker's batch
of ``--in-flight`` groups takes ``--gen-seconds``, a step ``--step-seconds``, workers join over
``--join-seconds``; the trainer polls as its loop does (``poll_delay``). ``--whole-want`` replays the old pacing
(every worker samples the whole want per status) for
comparison. Prints, per worker count: groups written, groups consumed (``steps x groups_per_step``), their
ratio, the peak number of rollout objects in the bucket, and the control requests the pacing cost.
"""

from __future__ import annotations

import argparse
import heapq
import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stoa.bench.fleet import _ints
from stoa.bench.records import Clock, RecordMaker, make_run
from stoa.bucket import Bucket, open_bucket
from stoa.layout import presence_prefix, rollouts_prefix
from stoa.trainer.demand import RolloutRetention, StatusPublisher, poll_delay, wanted_groups
from stoa.trainer.pool import RecordPool
from stoa.worker.pacing import RunWatch


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``stoa bench flood``.

    Args:
        p: the subcommand's parser.
    """
    p.add_argument("--workers", default="1,6,20", help="comma list of worker counts [default: 1,6,20]")
    p.add_argument("--steps", type=int, default=10, help="trainer steps [default: 10]")
    p.add_argument("--groups-per-step", type=int, default=4, help="groups a step takes [default: 4]")
    p.add_argument("--staleness-bound", type=int, default=3, help="the run's staleness bound [default: 3]")
    p.add_argument("--reuse-cap", type=int, default=2, help="steps that may use one record [default: 2]")
    p.add_argument("--in-flight", type=int, default=4, help="groups a worker samples per batch [default: 4]")
    p.add_argument("--gen-seconds", type=float, default=1.0, help="simulated seconds of one batch [default: 1]")
    p.add_argument("--step-seconds", type=float, default=2.0, help="simulated seconds of one step [default: 2]")
    p.add_argument("--status-seconds", type=float, default=10.0,
                   help="the trainer's status heartbeat (status_seconds) [default: 10]")
    p.add_argument("--join-seconds", type=float, default=0.0,
                   help="workers start spread evenly over this many simulated seconds [default: 0, all at once]")
    p.add_argument("--whole-want", action="store_true",
                   help="also run the old pacing: every worker samples the whole want per status")
    p.add_argument("--out", default="", help="append one JSONL row per scenario to this file")


@dataclass(frozen=True)
class FloodSettings:
    """One scenario's settings (see ``add_arguments``)."""

    workers: int
    steps: int = 10
    groups_per_step: int = 4
    staleness_bound: int = 3
    reuse_cap: int = 2
    in_flight: int = 4
    gen_seconds: float = 1.0
    step_seconds: float = 2.0
    status_seconds: float = 10.0
    worker_status_seconds: float = 0.5
    poll_seconds: float = 0.5
    join_seconds: float = 0.0
    whole_want: bool = False


@dataclass(frozen=True)
class FloodFigures:
    """What one scenario measured."""

    workers: int
    pacing: str
    written: int
    consumed: int
    ratio: float
    trained: int
    peak_objects: int
    window: int
    seconds: float
    status_writes: int
    presence_puts: int
    presence_lists: int


class WholeWant(RunWatch):
    """The old pacing, for comparison: every worker samples the whole want of each status it reads."""

    def _regrant(self, now: float) -> None:
        self._grant, self._grant_at, self._spent = self.status, now, 0

    @property
    def _share(self) -> int | None:
        s = self.status
        if not self.backpressure or s is None or s.state != "running":
            return None
        return s.wanted_groups


class Tally:
    """A bucket that counts rollout objects written and alive (the peak) and presence objects written.

    Args:
        inner: the bucket.
        run_id: the run id.
    """

    def __init__(self, inner: Bucket, run_id: str) -> None:
        self.inner, self.url = inner, inner.url
        self.rollouts, self.presence = rollouts_prefix(run_id), presence_prefix(run_id)
        self.written = self.alive = self.peak = self.presence_puts = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def put_create(self, key: str, data: bytes) -> None:
        """Create-only put, counted."""
        self.inner.put_create(key, data)
        if key.startswith(self.rollouts):
            self.written, self.alive = self.written + 1, self.alive + 1
            self.peak = max(self.peak, self.alive)
        elif key.startswith(self.presence):
            self.presence_puts += 1

    def delete_prefix(self, prefix: str) -> int:
        """Delete a prefix, counted."""
        n = self.inner.delete_prefix(prefix)
        if prefix.startswith(self.rollouts):
            self.alive -= n
        return n


class SimWorker:
    """One worker: the real ``RunWatch`` decides; sampling is simulated (a batch takes ``gen_seconds``).

    Args:
        index: the worker's number (its id is ``w<5 digits>``, as the records it writes).
        watch: its view of the run status.
    """

    def __init__(self, index: int, watch: RunWatch) -> None:
        self.index, self.watch, self.seq = index, watch, 0
        self.batch: tuple[int, int] | None = None
        """The batch being sampled: (groups, version)."""


def simulate(s: FloodSettings, bucket_dir: Path) -> FloodFigures:
    """Run ``s.workers`` workers against one trainer for ``s.steps`` steps on a local bucket under ``bucket_dir``.

    Args:
        s: the scenario.
        bucket_dir: an empty directory.
    """

    run = make_run("toy")
    run_id = run.contract.run_id
    bucket = Tally(open_bucket(str(bucket_dir)), run_id)
    clock = Clock()
    pool = RecordPool(bucket, run.contract, run.task, run.codec, staleness_bound=s.staleness_bound,  # type: ignore[arg-type]
                      reuse_cap=s.reuse_cap)
    status = StatusPublisher(bucket, run_id, s.status_seconds, clock=clock.wall, mono=clock)  # type: ignore[arg-type]
    retention = RolloutRetention(bucket, run_id, s.staleness_bound, 0)  # type: ignore[arg-type]
    maker = RecordMaker(run.contract, run.task, run.codec)
    watch_cls = WholeWant if s.whole_want else RunWatch
    workers = [SimWorker(i, watch_cls(bucket, run_id, stale_s=300.0, min_interval_s=s.worker_status_seconds,  # type: ignore[arg-type]
                                      clock=clock, worker_id=f"w{i:05d}")) for i in range(s.workers)]
    window = s.groups_per_step * (s.staleness_bound + 1)
    starts = [i * s.join_seconds / s.workers for i in range(s.workers)]
    queue: list[tuple[float, int, int]] = [(0.0, -1, 0)] + [(t, i, 0) for i, t in enumerate(starts)]  # trainer first
    version, step, empty, trained = 1, 0, 0, set()
    done, uid, tick = False, 0, 1
    while queue and not done:
        clock.t, who, _ = heapq.heappop(queue)
        if who < 0:  # the trainer: list, beat, step or wait (as stoa.trainer.loop does)
            empty = 0 if pool.refresh(version) else empty + 1
            status.beat(version, wanted_groups(s.groups_per_step, s.staleness_bound, pool.available()),
                        step_s=s.step_seconds, kept_from=retention.kept_from, step=step, seen=pool.entries.values())
            if pool.available() >= s.groups_per_step:
                trained.update(e.content_id for e in pool.take(s.groups_per_step))
                version, step = version + 1, step + 1
                retention.collect(version)
                done = step >= s.steps
                wait = s.step_seconds
            else:
                wait = poll_delay(s.poll_seconds, empty)
        else:
            w = workers[who]
            wait, uid = _worker_event(w, version, s, bucket, maker, uid)
        heapq.heappush(queue, (clock.t + wait, who, tick))
        tick += 1
    consumed = step * s.groups_per_step
    return FloodFigures(s.workers, "whole want" if s.whole_want else "shared", bucket.written, consumed,
                        round(bucket.written / consumed, 2) if consumed else 0.0, len(trained), bucket.peak, window,
                        round(clock.t, 1), status.writes, bucket.presence_puts, status.live.listings)


def _worker_event(w: SimWorker, version: int, s: FloodSettings, bucket: Any, maker: Any, uid: int) -> tuple[float, int]:
    """One step of a worker's loop (``stoa.worker.loop.run_worker``): upload a finished batch, then read the
    status and pause or start the next batch at the trainer's current version; return (seconds until its next
    event, the next record uid)."""
    if w.batch is not None:
        groups, at = w.batch
        for _ in range(groups):
            maker.put(bucket, w.index, w.seq, at, uid)
            w.seq, uid = w.seq + 1, uid + 1
        w.watch.spend(groups)
        w.batch = None
    verdict = w.watch.check()
    if verdict.action != "sample":
        return s.worker_status_seconds, uid
    w.batch = (w.watch.batch(s.in_flight), version)
    return s.gen_seconds, uid


def print_table(rows: list[FloodFigures]) -> None:
    """Print one line per scenario.

    Args:
        rows: the scenarios' figures.
    """
    print(f"\n{'workers':>7} {'pacing':10} {'written':>7} {'consumed':>8} {'ratio':>6} {'trained':>7} "
          f"{'peak obj':>8} {'window':>6} {'sim s':>6} {'status PUT':>10} {'presence PUT':>12} {'presence LIST':>13}")
    for r in rows:
        print(f"{r.workers:7d} {r.pacing:10} {r.written:7d} {r.consumed:8d} {r.ratio:6.2f} {r.trained:7d} "
              f"{r.peak_objects:8d} {r.window:6d} {r.seconds:6.1f} {r.status_writes:10d} {r.presence_puts:12d} "
              f"{r.presence_lists:13d}")


def main(args: argparse.Namespace) -> int:
    """Run every worker count (and the old pacing with ``--whole-want``), print the table, append JSONL rows.

    Args:
        args: parsed flags (see ``add_arguments``).
    """

    counts = _ints(args.workers, "--workers")
    if not counts or min(counts) < 1:
        raise SystemExit(f"--workers {args.workers!r}: give a comma list of worker counts >= 1, e.g. 1,6,20")
    rows = []
    with tempfile.TemporaryDirectory(prefix="stoa-flood-") as tmp:
        for n in counts:
            for whole in (False, True) if args.whole_want else (False,):
                s = FloodSettings(n, args.steps, args.groups_per_step, args.staleness_bound, args.reuse_cap,
                                  args.in_flight, args.gen_seconds, args.step_seconds, args.status_seconds,
                                  join_seconds=args.join_seconds, whole_want=whole)
                rows.append(simulate(s, Path(tmp) / f"{n}-{int(whole)}"))
                print(f"  {n} workers ({rows[-1].pacing}): ratio {rows[-1].ratio:.2f}", flush=True)
    print_table(rows)
    if args.out:
        with Path(args.out).open("a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "flood", **asdict(r)}) + "\n")
    return 0
