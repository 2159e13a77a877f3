"""Mixed-fleet benchmark (``stoa bench fleet --mix``): a heterogeneous fleet against one trainer, run twice, with
equal shares of the want (the pacing before per-worker speeds) and with pacing by speed (``stoa.worker.rate``).

Everything that paces is the real code on a local bucket, as in ``stoa bench flood``: each worker decides through
:class:`stoa.worker.pacing.RunWatch`, the trainer ingests with the real ``RecordPool``, publishes the want, the
live count and the fleet's speed with the real ``StatusPublisher`` and deletes old rollouts with
``RolloutRetention``. Sampling and training are simulated on one clock: a worker of a class samples ``speed``
groups a minute (each batch jittered by up to 10%), in batches of at most its ``in_flight`` groups, and reports
its seconds per group on its records; a step takes ``--mix-step-seconds``. Classes may start late and stop early.

Per class it prints groups sampled, trained (taken at least once), late (landed after their version left the
window), stale (landed inside it, never taken), pending (still inside the window at the end: not counted as
waste), the lag histogram of trained groups (versions behind the trainer at each take), and idle share (seconds
paused while the trainer wanted groups, over the seconds alive).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stoa.bench.records import Clock, RecordMaker, make_run
from stoa.bucket import open_bucket
from stoa.trainer.demand import RolloutRetention, StatusPublisher, poll_delay, wanted_groups
from stoa.trainer.pool import RecordPool
from stoa.worker.pacing import RunWatch

DEFAULT_CLASSES = "fast:1:30:16,medium:50:2:8,slow:20:1.5:8:120:1500"
"""name:count:groups per minute:groups in flight[:start s[:stop s[:reported groups per minute[:greedy]]]] per
class (a reported speed other than 0 is a lie written on every record; greedy 1: the class ignores its share)."""
SPEC = "name:count:groups_per_min:in_flight[:start_s[:stop_s[:reported_per_min[:greedy]]]]"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--mix`` flags of ``stoa bench fleet``.

    Args:
        p: the subcommand's parser.
    """
    p.add_argument("--mix", action="store_true", help="run the mixed-fleet pacing benchmark instead (see --classes)")
    p.add_argument("--classes", default=DEFAULT_CLASSES,
                   help=f"--mix: comma list of {SPEC} (reported: the speed its records claim, 0: the true one; "
                        f"greedy 1: samples regardless of its share) [default: {DEFAULT_CLASSES}]")
    p.add_argument("--mix-steps", type=int, default=80, help="--mix: trainer steps [default: 80]")
    p.add_argument("--mix-groups-per-step", type=int, default=48, help="--mix: groups a step takes [default: 48]")
    p.add_argument("--mix-step-seconds", type=float, default=20.0, help="--mix: seconds of a step [default: 20]")
    p.add_argument("--mix-window", type=int, default=3, help="--mix: the staleness bound [default: 3]")
    p.add_argument("--mix-status-seconds", type=float, default=2.0,
                   help="--mix: how often workers read the status (status_seconds) [default: 2]")


@dataclass(frozen=True)
class WorkerClass:
    """Workers of one kind: how many, their speed, their batch, when they run."""

    name: str
    count: int
    speed: float
    """Groups a minute."""
    in_flight: int
    start_s: float = 0.0
    stop_s: float = 0.0
    """0: never stops."""
    reported: float = 0.0
    """The speed its records claim, groups a minute (0: the true one)."""
    greedy: bool = False
    """Samples regardless of its share and pace (``backpressure = false``, ``pacing = false``): a flood."""


@dataclass(frozen=True)
class MixSettings:
    """One run's settings (see ``add_arguments``)."""

    classes: tuple[WorkerClass, ...]
    pacing: bool
    steps: int = 80
    groups_per_step: int = 48
    step_seconds: float = 20.0
    staleness_bound: int = 3
    reuse_cap: int = 2
    status_seconds: float = 10.0
    worker_status_seconds: float = 2.0
    poll_seconds: float = 0.5
    seed: int = 0


@dataclass
class ClassFigures:
    """What one class did in a run."""

    sampled: int = 0
    trained: int = 0
    late: int = 0
    stale: int = 0
    pending: int = 0
    lags: Counter = field(default_factory=Counter)
    alive_s: float = 0.0
    idle_s: float = 0.0

    @property
    def trained_share(self) -> float:
        """Trained groups over the sampled ones that left the window (pending ones excluded)."""
        done = self.sampled - self.pending
        return self.trained / done if done else 0.0


def parse_classes(text: str) -> tuple[WorkerClass, ...]:
    """Parse ``--classes``.

    Args:
        text: comma list of ``SPEC``.
    """
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        f = part.split(":")
        try:
            opt = [float(x) if x else 0.0 for x in f[4:7]] + [0.0] * (7 - len(f[:7]))
            c = WorkerClass(f[0], int(f[1]), float(f[2]), int(f[3]), opt[0], opt[1], opt[2], f[7:8] == ["1"])
        except (IndexError, ValueError, TypeError):
            raise SystemExit(f"--classes {part!r}: give {SPEC}, e.g. slow:20:0.5:8:120:1500") from None
        if c.count < 1 or not c.speed > 0 or c.in_flight < 1:
            raise SystemExit(f"--classes {part!r}: count, speed and in_flight must be > 0")
        out.append(c)
    return tuple(out)


@dataclass
class _Worker:
    index: int
    cls: WorkerClass
    watch: RunWatch
    seq: int = 0
    batch: tuple[int, int, float] | None = None
    """The batch being sampled: (groups, version, seconds)."""
    last_t: float = 0.0


class _Sim:
    """The run's shared state: the trainer's version and want, records written and trained, per class."""

    def __init__(self, s: MixSettings, bucket_dir: Path) -> None:
        self.s = s
        run = make_run("toy")
        self.run_id, self.maker = run.contract.run_id, RecordMaker(run.contract, run.task, run.codec)
        self.bucket = open_bucket(str(bucket_dir))
        self.clock = Clock()
        self.pool = RecordPool(self.bucket, run.contract, run.task, run.codec, staleness_bound=s.staleness_bound,
                               reuse_cap=s.reuse_cap)
        self.status = StatusPublisher(self.bucket, self.run_id, s.status_seconds, clock=self.clock.wall,
                                      mono=self.clock, groups_per_step=s.groups_per_step)
        self.retention = RolloutRetention(self.bucket, self.run_id, s.staleness_bound, 0)
        self.rng = random.Random(s.seed)
        self.version, self.step, self.want, self.uid, self.empty = 1, 0, 1, 0, 0
        self.records: dict[tuple[str, int], tuple[str, int]] = {}
        """(worker id, seq) -> (class, policy version) of every record written."""
        self.trained: set[tuple[str, int]] = set()
        self.figures = {c.name: ClassFigures() for c in s.classes}
        self.step_lags: list[float] = []
        self.workers = [_Worker(i, c, RunWatch(self.bucket, self.run_id, stale_s=600.0,
                                               min_interval_s=s.worker_status_seconds, clock=self.clock,
                                               worker_id=f"w{i:05d}", pacing=s.pacing and not c.greedy,
                                               backpressure=not c.greedy,
                                               staleness_bound=s.staleness_bound), last_t=c.start_s)
                        for i, c in enumerate(c for c in s.classes for _ in range(c.count))]

    def trainer_event(self) -> float:
        """List, beat, step or wait, as ``stoa.trainer.loop`` does; return seconds to the next event."""
        s = self
        got = s.pool.refresh(s.version)
        s.empty = 0 if got else s.empty + 1
        s.want = wanted_groups(s.s.groups_per_step, s.s.staleness_bound, s.pool.available())
        s.status.beat(s.version, s.want, step_s=s.s.step_seconds, kept_from=s.retention.kept_from, step=s.step,
                      seen=s.pool.entries.values())
        if s.pool.available() < s.s.groups_per_step:
            return poll_delay(s.s.poll_seconds, s.empty)
        lags = []
        for e in s.pool.take(s.s.groups_per_step):
            key = (e.record.worker_id, e.record.seq)
            name, _ = s.records[key]
            lag = s.version - e.record.policy_version
            s.figures[name].lags[lag] += 1
            lags.append(lag)
            s.trained.add(key)
        s.step_lags.append(sum(lags) / len(lags))
        s.version, s.step = s.version + 1, s.step + 1
        s.retention.collect(s.version)
        return s.s.step_seconds

    def worker_event(self, w: _Worker) -> float | None:
        """Land a finished batch, then pause or start the next one; return seconds to its next event (None: it
        stopped)."""
        now, f = self.clock.t, self.figures[w.cls.name]
        f.alive_s += now - w.last_t
        w.last_t = now
        if w.batch is not None:
            groups, at, seconds = w.batch
            for _ in range(groups):
                claimed = 60.0 / w.cls.reported if w.cls.reported else seconds / groups
                self.maker.put(self.bucket, w.index, w.seq, at, self.uid, generate_s=claimed)
                self.records[(f"w{w.index:05d}", w.seq)] = (w.cls.name, at)
                if at < self.version - self.s.staleness_bound:
                    f.late += 1
                w.seq, self.uid = w.seq + 1, self.uid + 1
            f.sampled += groups
            w.watch.spend(groups)
            w.batch = None
        if w.cls.stop_s and now >= w.cls.stop_s:
            return None
        verdict = w.watch.check()
        if verdict.action != "sample":
            wait = w.watch.pause_s(verdict, self.s.worker_status_seconds)  # a paced worker wakes as its pace ends
            if self.want > 0:
                f.idle_s += wait
            return wait
        k = w.watch.batch(w.cls.in_flight)
        seconds = k * 60.0 / w.cls.speed * self.rng.uniform(0.9, 1.1)
        w.batch = (k, self.version, seconds)
        return seconds

    def finish(self) -> None:
        """Sort every untrained record: pending (still inside the window) or stale (late ones counted already)."""
        low = self.version - self.s.staleness_bound
        for key, (name, at) in self.records.items():
            f = self.figures[name]
            if key in self.trained:
                f.trained += 1
            elif at >= low:
                f.pending += 1
            elif at >= 0:
                f.stale += 1
        for f in self.figures.values():
            f.stale -= f.late  # late records are untrained and out of the window too


def simulate(s: MixSettings, bucket_dir: Path) -> _Sim:
    """Run the fleet against one trainer for ``s.steps`` steps; return the finished simulation.

    Args:
        s: the settings.
        bucket_dir: an empty directory.
    """
    sim = _Sim(s, bucket_dir)
    queue: list[tuple[float, int, int]] = [(0.0, -1, 0)] + [(w.cls.start_s, w.index, 0) for w in sim.workers]
    heapq.heapify(queue)
    tick = 1
    while queue and sim.step < s.steps:
        sim.clock.t, who, _ = heapq.heappop(queue)
        wait = sim.trainer_event() if who < 0 else sim.worker_event(sim.workers[who])
        if wait is not None:
            heapq.heappush(queue, (sim.clock.t + wait, who, tick))
            tick += 1
    sim.finish()
    return sim


def rows(sim: _Sim) -> list[dict[str, Any]]:
    """One row per class and one for the fleet."""
    out = []
    total = ClassFigures()
    for name, f in sim.figures.items():
        out.append({"class": name, **_row(f)})
        for k in ("sampled", "trained", "late", "stale", "pending", "alive_s", "idle_s"):
            setattr(total, k, getattr(total, k) + getattr(f, k))
        total.lags.update(f.lags)
    out.append({"class": "all", **_row(total)})
    return out


def _row(f: ClassFigures) -> dict[str, Any]:
    n = sum(f.lags.values()) or 1
    return {**{k: v for k, v in asdict(f).items() if k != "lags"}, "trained_share": f.trained_share,
            "lag_share": {str(k): f.lags[k] / n for k in sorted(f.lags)},
            "idle_share": f.idle_s / f.alive_s if f.alive_s else 0.0}


def print_table(title: str, sim: _Sim, window: int) -> None:
    """Print one run's per-class table, then the per-step mean lag's spread.

    Args:
        title: the run's name.
        sim: the finished simulation.
        window: the staleness bound.
    """
    lags = "/".join(f"lag{k}" for k in range(window + 1))
    print(f"\n{title}: {sim.step} steps in {sim.clock.t / 60:.1f} simulated min")
    print(f"{'class':8} {'sampled':>7} {'trained':>7} {'late':>5} {'stale':>5} {'pending':>7} {'trained%':>8} "
          f"{'idle%':>6}  {lags} %")
    for r in rows(sim):
        hist = "/".join(f"{100 * r['lag_share'].get(str(k), 0.0):.0f}" for k in range(window + 1))
        print(f"{r['class']:8} {r['sampled']:7d} {r['trained']:7d} {r['late']:5d} {r['stale']:5d} {r['pending']:7d} "
              f"{100 * r['trained_share']:7.1f}% {100 * r['idle_share']:5.1f}%  {hist}")
    r = sim.status.rates
    print(f"reported speeds rejected {r.rejected}, workers counted at the cap {r.capped}, excess groups {r.excess}")
    m = sim.step_lags
    mean = sum(m) / len(m) if m else 0.0
    spread = (sum((x - mean) ** 2 for x in m) / len(m)) ** 0.5 if m else 0.0
    print(f"mean lag per step: {mean:.2f}, its std across steps {spread:.2f} (a 0 -> {window} -> 0 cycle: about "
          f"{(((window + 1) ** 2 - 1) / 12) ** 0.5:.2f}); first steps: {' '.join(f'{x:.1f}' for x in m[:16])}")


def main(args: argparse.Namespace) -> int:
    """Run the fleet with equal shares, then with pacing by speed; print both tables, append JSONL to ``--out``.

    Args:
        args: parsed flags (``stoa.bench.fleet.add_arguments``).
    """
    classes = parse_classes(args.classes)
    out = []
    with tempfile.TemporaryDirectory(prefix="stoa-mix-") as tmp:
        for pacing in (False, True):
            s = MixSettings(classes, pacing, args.mix_steps, args.mix_groups_per_step, args.mix_step_seconds,
                            args.mix_window, args.reuse_cap, worker_status_seconds=args.mix_status_seconds,
                            poll_seconds=args.poll_seconds, seed=args.seed)
            sim = simulate(s, Path(tmp) / f"p{int(pacing)}")
            title = "pacing by speed (pacing = true)" if pacing else "equal shares (pacing = false, before)"
            print_table(title, sim, s.staleness_bound)
            out += [{"bench": "fleet-mix", "pacing": pacing, **r} for r in rows(sim)]
    if args.out:
        with Path(args.out).open("a") as f:
            for r in out:
                f.write(json.dumps(r) + "\n")
    return 0
