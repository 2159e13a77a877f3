"""What ``stoa plot`` draws, read from a run's metrics chunks: the panels and each run's curves.

Every metrics chunk is untrusted (any bucket writer can forge one): a row or value that is not a plain finite
number where one is expected is skipped, never an exception. Plain data, no matplotlib.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from stoa.layout import parse_rollout_key, rollouts_prefix
from stoa.telemetry.metrics import ReadCounts, read_sourced_chunks

MAX_CHUNK_BYTES = 64 << 20
"""A metrics chunk larger than this is skipped (the trainer's are a few kB)."""
MAX_ABS = 1e12
"""A value whose magnitude exceeds this is skipped (no metric of stoa's gets near it)."""
MAX_VERSION = 10**8 - 1
"""The largest version a rollout key can spell (8 digits)."""
TRAINER_SOURCE = "trainer"
WORKER_SOURCE = "worker-"
"""A worker's own metrics chunks are written by source ``worker-<worker id>``."""
TIME_RANGE = (1e9, 1e10)
"""Plausible unix times of a row (2001..2286); others are left off the wall-time axis."""
WORKER_WINDOW = 4
"""The worker count at version v counts the workers whose records were sampled at versions v-3..v."""
SAMPLED_KEY = "worker/tokens_per_s"
"""A worker's row with this key logs a batch it sampled (pause and weight-sync rows do not have it)."""


class Metric(NamedTuple):
    """One curve of a panel.

    Args:
        key: the metrics row key (``rollout/reward_mean``) or ``workers`` for the derived worker count.
        label: its legend label inside the panel.
    """

    key: str
    label: str


class Panel(NamedTuple):
    """One axes of the figure.

    Args:
        name: stable id (tests and callers address panels by it).
        title: the axes title.
        metrics: the curves it draws.
        first_only: draw only the first metric a run has (eval: cover-EM for search tasks, else accuracy).
    """

    name: str
    title: str
    metrics: tuple[Metric, ...]
    first_only: bool = False


PANELS: tuple[Panel, ...] = (
    Panel("reward", "rollout reward (mean)", (Metric("rollout/reward_mean", "reward"),)),
    Panel("eval", "held-out eval", (Metric("eval/cover_em", "cover-EM"), Metric("eval/accuracy", "accuracy")),
          first_only=True),
    Panel("loss", "train loss", (Metric("train/loss", "loss"),)),
    Panel("kl", "KL to the reference", (Metric("train/kl", "kl"),)),
    Panel("clip", "clip / gate fractions", (Metric("train/clip_frac_low", "clip low"),
                                            Metric("train/clip_frac_high", "clip high"),
                                            Metric("train/gate_frac", "gate"))),
    Panel("lag", "version lag of trained records", (Metric("rollout/lag_mean", "mean"),
                                                    Metric("rollout/lag_max", "max"))),
    Panel("records", "records accepted per second", (Metric("rollout/records_per_s", "records/s"),)),
    Panel("workers", "workers sampling (records sampled in the last 4 versions)", (Metric("workers", "workers"),)),
)
SEARCH_PANEL = Panel("search", "search rate (episodes that searched)",
                     (Metric("eval/search_rate", "held-out (greedy)"), Metric("rollout/search_rate", "training")))
"""Drawn right after ``eval`` when some run logged a search rate (a search task's eval or rollout metrics)."""
TRAINER_ONLY = ("train/", "rollout/")
"""Metric prefixes read from the trainer's chunks only (``eval/*`` may come from any writer, e.g. an evaluator)."""


@dataclass
class Points:
    """One curve's points: ``(version, unix time or None, value)``."""

    rows: list[tuple[int, float | None, float]] = field(default_factory=list)


@dataclass
class RunCurves:
    """Every curve of one run, ready to draw.

    Args:
        run_id: the run.
        start: unix time of the run's first row (wall-time axis origin); None when no row had a time.
        curves: metric key -> its points.
    """

    run_id: str
    start: float | None
    curves: dict[str, Points]


def number(value: Any) -> float | None:
    """``value`` as a plausible finite float, else None (bools, strings, NaN, huge numbers).

    Args:
        value: an untrusted JSON value.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        f = float(value)
    except OverflowError:  # a huge JSON integer
        return None
    return f if math.isfinite(f) and abs(f) <= MAX_ABS else None


def version_of(value: Any) -> int | None:
    """``value`` as a policy version (an int in 0..MAX_VERSION), else None.

    Args:
        value: an untrusted JSON value.
    """
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_VERSION else None


def read_sourced_rows(bucket: Any, run_id: str, counts: ReadCounts | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Every JSON-object row of a run's metrics chunks with the writer (``source``) of its chunk.

    Chunks are read in writer, process start, chunk order through the bounded parser of ``stoa.telemetry.metrics``: a
    chunk over :data:`MAX_CHUNK_BYTES`, one deleted since the listing and any line that is not a bounded JSON
    object (too deep, a number too long, NaN, invalid UTF-8) are skipped, one warning line per chunk.

    Args:
        bucket: the run's bucket.
        run_id: the run id.
        counts: where skipped chunks and lines are added up (optional).
    """
    return read_sourced_chunks(bucket, run_id, max_chunk_bytes=MAX_CHUNK_BYTES, counts=counts)


def worker_versions(source: str, row: dict[str, Any]) -> list[tuple[int, str]]:
    """``(version, worker id)`` pairs one row attests: a worker's row of a batch it sampled (``worker/version``
    with ``worker/tokens_per_s``, in a ``worker-<id>`` chunk). Other rows (a worker's pause or weight-sync rows,
    the trainer's, an evaluator's) attest none: the trainer's ``rollout/keys`` are the records it trained on.

    Args:
        source: the writer of the row's chunk.
        row: an untrusted metrics row.
    """
    if not source.startswith(WORKER_SOURCE) or number(row.get(SAMPLED_KEY)) is None:
        return []
    v = version_of(row.get("worker/version"))
    return [(v, source[len(WORKER_SOURCE):])] if v is not None else []


def listed_records(bucket: Any, run_id: str) -> list[tuple[int, str]]:
    """``(version, worker id)`` of every record key under the run's rollouts (the records sampled that retention
    has not deleted yet: a worker whose metrics chunk has not landed is counted from them).

    Args:
        bucket: the run's bucket.
        run_id: the run id.
    """

    parsed = (parse_rollout_key(run_id, info.key) for info in bucket.list(rollouts_prefix(run_id)))
    return [(k.version, k.worker_id) for k in parsed if k is not None]


def run_curves(run_id: str, rows: Sequence[tuple[str, dict[str, Any]]],
               records: Sequence[tuple[int, str]] = ()) -> RunCurves:
    """Extract every panel's curves from a run's sourced rows, skipping whatever is malformed.

    Args:
        run_id: the run.
        rows: ``(source, row)`` pairs (``read_sourced_rows``).
        records: ``(version, worker id)`` of the record keys listed in the bucket (``listed_records``).
    """
    keys = [m.key for p in (*PANELS, SEARCH_PANEL) for m in p.metrics if m.key != "workers"]
    curves: dict[str, Points] = defaultdict(Points)
    seen: dict[int, set[str]] = defaultdict(set)
    for v, wid in records:
        seen[v].add(wid)
    published: dict[int, float] = {}
    first_seen: dict[int, float] = {}
    times = []
    for source, row in rows:
        t = number(row.get("time"))
        t = t if t is not None and TIME_RANGE[0] <= t <= TIME_RANGE[1] else None
        times += [t] if t is not None else []
        for v, wid in worker_versions(source, row):
            seen[v].add(wid)
            if t is not None:
                first_seen[v] = min(first_seen.get(v, t), t)
        v = version_of(row.get("version"))
        if v is None:
            continue
        if source == TRAINER_SOURCE and t is not None and "train/loss" in row:
            published.setdefault(v, t)
        for key in keys:
            value = number(row.get(key))
            if value is not None and (source == TRAINER_SOURCE or not key.startswith(TRAINER_ONLY)):
                curves[key].rows.append((v, t, value))
    for v in sorted(seen):
        ids = set().union(*(seen.get(u, ()) for u in range(v - WORKER_WINDOW + 1, v + 1)))
        curves["workers"].rows.append((v, published.get(v, first_seen.get(v)), float(len(ids))))
    return RunCurves(run_id, min(times) if times else None, dict(curves))


def load_run(bucket: Any, run_id: str) -> RunCurves:
    """Read one run's metrics from the bucket.

    Args:
        bucket: the bucket.
        run_id: the run id.
    """
    return run_curves(run_id, read_sourced_rows(bucket, run_id), listed_records(bucket, run_id))


def panels_for(runs: Sequence[RunCurves]) -> tuple[Panel, ...]:
    """The panels of a figure of ``runs``: every one of :data:`PANELS`, plus :data:`SEARCH_PANEL` after ``eval``
    when some run has a point of one of its curves.

    Args:
        runs: the runs to draw (``load_run``).
    """
    keys = {m.key for m in SEARCH_PANEL.metrics}
    if not any(run.curves.get(k) is not None and run.curves[k].rows for run in runs for k in keys):
        return PANELS
    at = next(i for i, p in enumerate(PANELS) if p.name == "eval") + 1
    return (*PANELS[:at], SEARCH_PANEL, *PANELS[at:])
