"""The churn benchmark's plan and books (``stoa bench fleet --churn``, driven by ``stoa.bench.churn``): the seeded
schedule of workers joining and leaving (and the trainer's one kill -9), and the accounting of a finished run from
what the trainer and the workers wrote (the trainer's metrics rows, the records in the bucket, the workers' own
metrics files), never from printed text. Nothing here starts a process.

A run is measured over a window that opens at the trainer's first step (every process started) and closes when the
bench stops it. Its useful groups are the distinct records its steps name in ``rollout/keys`` (however often
reused). The records that landed in the window are booked as trained (by any step), pending, stale or surplus, and
``lost`` apart:

- ``trained``: records that some step's ``rollout/keys`` names;
- ``pending``: untrained records still inside the staleness window when the run stopped (not waste);
- ``stale``: untrained records that landed after their version had left the window;
- ``surplus`` (over the want): untrained records that landed inside the window and aged out of it untaken;
  ``refused`` counts, from the step rows, the groups the trainer dropped instead of training (skipped as uniform,
  filtered, rejected): they are among the surplus (and the stale) without being over the want;
- ``lost``: groups in flight when their worker was killed, never uploaded. Estimated: a worker whose last metrics
  row before its kill says it was paused lost nothing, else its last batch (``groups_in_flight`` before its first).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoa.rollouts.records import RolloutRecord
from stoa.telemetry.metrics import read_metrics

SIGNALS = ("KILL", "TERM")
"""How a leaving worker is stopped: SIGKILL or SIGTERM, drawn per leave."""


@dataclass(frozen=True)
class Event:
    """One change to the fleet at ``t`` seconds after the run's start."""

    t: float
    kind: str
    """``join``, ``leave`` or ``trainer`` (the trainer is killed with SIGKILL and restarted at once)."""
    worker: str = ""
    """The worker's label (``join``, ``leave``)."""
    signal: str = ""
    """``KILL`` or ``TERM`` (``leave``)."""


@dataclass(frozen=True)
class Schedule:
    """A run's fleet over time: the workers live at 0, then the events in time order."""

    initial: tuple[str, ...]
    events: tuple[Event, ...]
    duration_s: float

    def sizes(self) -> list[tuple[float, int]]:
        """(time, live workers from then on) at 0 and at every join or leave."""
        out, n = [(0.0, len(self.initial))], len(self.initial)
        for e in self.events:
            if e.kind in ("join", "leave"):
                n += 1 if e.kind == "join" else -1
                out.append((e.t, n))
        return out

    def mean_size(self) -> float:
        """Live workers averaged over the run's duration (time-weighted)."""
        pts = self.sizes() + [(self.duration_s, 0)]
        return sum((b[0] - a[0]) * a[1] for a, b in zip(pts, pts[1:], strict=False)) / self.duration_s


def bounds(workers: int) -> tuple[int, int]:
    """The fewest and most live workers of a churned fleet of ``workers`` on average: symmetric around it.

    Args:
        workers: the fleet's average size (>= 1).
    """
    low = max(1, math.ceil(workers / 2))
    return low, 2 * workers - low


def plan(workers: int, mean_s: float, duration_s: float, seed: int, restart_at: float | None = None) -> Schedule:
    """A seeded schedule: inter-event times exponential with mean ``mean_s``; each event a join or a leave with
    equal odds inside ``bounds(workers)`` (a join at the fewest, a leave at the most); a leaving worker is drawn
    from the live ones and stopped by a signal drawn from ``SIGNALS``; joiners get fresh labels.

    Args:
        workers: live workers at the start, and the size the fleet wanders around.
        mean_s: mean seconds between events.
        duration_s: the run's length; no event at or after it.
        seed: random seed.
        restart_at: seconds at which the trainer is killed and restarted (None: never).

    Raises:
        ValueError: ``workers`` < 1 or ``mean_s`` or ``duration_s`` not > 0.
    """
    if workers < 1 or not mean_s > 0 or not duration_s > 0:
        raise ValueError(f"churn plan: workers {workers} must be >= 1 and mean_s {mean_s}, duration_s "
                         f"{duration_s} > 0; pass --churn-workers >= 1 and positive seconds")
    rng = random.Random(seed)
    low, high = bounds(workers)
    live = [f"c{i:02d}" for i in range(workers)]
    initial, events, t, made = tuple(live), [], 0.0, workers
    while (t := t + rng.expovariate(1.0 / mean_s)) < duration_s:
        n = len(live)
        if n < high and (n <= low or rng.random() < 0.5):
            live.append(f"c{made:02d}")
            made += 1
            events.append(Event(t, "join", live[-1]))
        else:
            gone = live.pop(rng.randrange(n))
            events.append(Event(t, "leave", gone, rng.choice(SIGNALS)))
    if restart_at is not None and 0 < restart_at < duration_s:
        events.append(Event(restart_at, "trainer"))
    return Schedule(initial, tuple(sorted(events, key=lambda e: e.t)), duration_s)


def steady(workers: int, duration_s: float) -> Schedule:
    """The steady fleet: ``workers`` live throughout, no event.

    Args:
        workers: the fleet's size.
        duration_s: the run's length.
    """
    return Schedule(tuple(f"s{i:02d}" for i in range(workers)), (), duration_s)


@dataclass(frozen=True)
class Landed:
    """One record in the bucket, as the books need it."""

    label: str
    """``v<version>/<worker>-<seq>.rec``, as ``rollout/keys`` names it."""
    worker: str
    version: int
    created_at: float
    generate_s: float


@dataclass(frozen=True)
class Mark:
    """A worker the bench started or stopped at wall time ``at``."""

    worker: str
    """Its label (its worker id is the label plus ``-`` and a suffix)."""
    at: float


@dataclass(frozen=True)
class Books:
    """What one run did between its start and its stop (wall times), from the files it left."""

    wall_s: float
    steps: int
    trained: int
    sampled: int
    pending: int
    stale: int
    surplus: int
    lost: int
    mean_workers: float
    refused: int = 0
    """Groups the window's step rows say were skipped as uniform, filtered or rejected (not trained)."""
    join_s: float = 0.0
    """Mean seconds from a mid-run join to that worker's first record (0: none uploaded; ``join_delays``)."""
    restart_s: float = 0.0
    """Seconds from the trainer's kill to its successor's first step (0: no restart; ``restart_gaps``)."""

    @property
    def per_min(self) -> float:
        """Useful (distinct trained) groups per minute of the run's wall time."""
        return 60.0 * self.trained / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def wasted(self) -> int:
        """Groups sampled or in flight that no step will use: stale, surplus, lost."""
        return self.stale + self.surplus + self.lost


def tally(rows: Sequence[dict[str, Any]], landed: Iterable[Landed], *, t0: float, t_end: float, bound: int,
          lost: int, mean_workers: float) -> Books:
    """Book a run's window ``[t0, t_end]`` (wall times): its steps and the distinct groups they trained (the
    useful ones), and the records that landed in it sorted into trained (by any step up to ``t_end``), pending,
    stale and surplus (see the module's doc).

    Args:
        rows: the trainer's step rows (``time``, ``version``, ``rollout/keys``), every trainer process's.
        landed: the run's records.
        t0: the window's start.
        t_end: when the bench stopped the run.
        bound: the staleness bound.
        lost: groups lost in flight (``lost_in_flight``).
        mean_workers: the schedule's mean size.
    """
    done = [r for r in rows if r["time"] <= t_end]
    window = [r for r in done if r["time"] >= t0]
    ever = {k for r in done for k in r.get("rollout/keys", [])}
    published = {int(r["version"]): float(r["time"]) for r in done}
    final = max(published, default=1)
    books = {"pending": 0, "stale": 0, "surplus": 0}
    sampled = 0
    for rec in landed:
        if not t0 <= rec.created_at <= t_end:
            continue
        sampled += 1
        if rec.label in ever:
            continue
        if rec.version >= final - bound:
            books["pending"] += 1
        elif rec.created_at > published.get(rec.version + bound + 1, math.inf):
            books["stale"] += 1
        else:
            books["surplus"] += 1
    useful = {k for r in window for k in r.get("rollout/keys", [])}
    refused = sum(int(v) for r in window for k, v in r.items()
                  if k in ("rollout/skipped_uniform", "rollout/filtered") or k.startswith("rollout/rejected/"))
    return Books(t_end - t0, len(window), len(useful), sampled, lost=lost, mean_workers=mean_workers,
                 refused=refused, **books)


def lost_in_flight(kills: Iterable[Mark], worker_rows: dict[str, list[dict[str, Any]]],
                   landed: Sequence[Landed], in_flight: int) -> int:
    """Estimated groups in flight when the bench killed workers: 0 for a worker whose last metrics row before its
    kill says it paused (or that wrote no row: still starting), else its last batch's size (records sharing the
    last ``generate_s``), ``in_flight`` before its first record.

    Args:
        kills: the workers killed.
        worker_rows: each worker label's metrics rows.
        landed: the run's records.
        in_flight: the workers' ``groups_in_flight``.
    """
    total = 0
    for k in kills:
        before = [r for r in worker_rows.get(k.worker, []) if r.get("time", math.inf) <= k.at]
        if not before or before[-1].get("worker/paused") == 1:
            continue
        mine = sorted((r for r in landed if _label_of(r.worker) == k.worker and r.created_at <= k.at),
                      key=lambda r: r.created_at)
        total += sum(1 for r in mine if r.generate_s == mine[-1].generate_s) if mine else in_flight
    return total


def join_delays(joins: Iterable[Mark], landed: Sequence[Landed]) -> list[float]:
    """Seconds from each worker's start to its first record (process start, weights, being counted by the trainer);
    workers that uploaded nothing are left out.

    Args:
        joins: the workers started mid-run.
        landed: the run's records.
    """
    first: dict[str, float] = {}
    for r in landed:
        label = _label_of(r.worker)
        first[label] = min(first.get(label, math.inf), r.created_at)
    return [first[j.worker] - j.at for j in joins if j.worker in first]


def restart_gaps(rows: Sequence[dict[str, Any]], kills: Iterable[float]) -> list[float]:
    """Seconds from each trainer kill to the next step row (the restarted trainer's first step).

    Args:
        rows: the trainer's step rows.
        kills: when the trainer was killed (wall times).
    """
    times = sorted(float(r["time"]) for r in rows)
    return [min((t for t in times if t > k), default=math.inf) - k for k in kills]


def _label_of(worker_id: str) -> str:
    """The label a worker id was made from (``stoa.worker.loop.worker_id`` adds ``-`` and 6 hex digits)."""
    return worker_id.rsplit("-", 1)[0]


def read_landed(root: Path, run: str) -> list[Landed]:
    """Every record of a local bucket's run.

    Args:
        root: the bucket's directory.
        run: the run id.
    """
    out = []
    for path in sorted((root / "runs" / run / "rollouts").glob("v*/*.rec")):
        rec = RolloutRecord.decode(path.read_bytes())
        out.append(Landed(f"{path.parent.name}/{path.name}", rec.worker_id, rec.policy_version, rec.created_at,
                          float(rec.timings.get("generate_s", 0.0))))
    return out


def read_rows(root: Path, run: str) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """The trainer's step rows and each worker label's metrics rows, from a local bucket's run.

    Args:
        root: the bucket's directory.
        run: the run id.
    """
    metrics = root / "runs" / run / "metrics"
    steps = [r for r in read_metrics(metrics / "trainer.jsonl") if "train/loss" in r]
    workers: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(metrics.glob("worker-*.jsonl")):
        wid = path.stem.removeprefix("worker-")
        if len(wid.rsplit("-", 1)[-1]) == 6:  # worker-<label>-<6 hex>.jsonl; not the bucket's chunk copies
            workers.setdefault(_label_of(wid), []).extend(read_metrics(path))
    return steps, workers
