"""Metrics rows (untrusted) to the figures of ``stoa status``: the training curves and the worker table.

Every value is read through :func:`num` (finite numbers only), every label through the layout's parsers,
so a forged row can make a figure wrong but never raise.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stoa.layout import parse_rollout_key, rollouts_prefix

if TYPE_CHECKING:
    from stoa.layout import RolloutKey
    from stoa.observe.snapshot import Snapshot, _Chunk, _Reader

RECENT_STEPS = 20
"""Steps the rate, records/s and lag histogram are computed over."""
WORKER_CHUNKS = 4
"""Newest chunks read per worker (fewer once a chunk reaches back before the window)."""
MAX_WORKERS = 64
"""Workers whose metrics chunks one snapshot reads (the most recently seen first)."""
MAX_REASONS = 64
"""Distinct rejection reasons kept (forged rows could invent any number)."""
WORKER_SOURCE = "worker-"
"""Metrics chunks of a worker are written by source ``worker-<worker id>``."""


def eval_points(rows: list[dict[str, Any]]) -> list[dict[str, float | None]]:
    """The evaluation rows (``eval/accuracy`` or ``eval/cover_em``) as version + figures, in row order.

    Args:
        rows: metrics rows of the trainer or of an evaluator (``stoa eval``).
    """
    return [{"version": version_of(r.get("version")), **{
        name: v for name in ("accuracy", "cover_em", "em", "n") if (v := num(r.get(f"eval/{name}"))) is not None}}
        for r in rows if num(r.get("eval/accuracy")) is not None or num(r.get("eval/cover_em")) is not None]


@dataclass(frozen=True)
class WorkerView:
    """One worker seen in the window.

    Args:
        name: the worker id.
        engine: ``torch``/``mlx`` from its metrics (empty: unknown).
        versions: the lowest and highest policy versions seen for it in the window (empty: none).
        groups: records it uploaded in the window (its metrics), else accepted by the trainer, else listed.
        tokens_per_s: mean sampling throughput in the window (None: no metrics).
        sync_s: mean weight-sync seconds in the window (None: no sync in the window or no metrics).
        rejected: its records the trainer rejected (the trainer's journal; None: unknown).
        quarantine: the trainer's quarantine reason for it (empty: not quarantined).
        last_seen_age_s: seconds since its newest metrics row or accepted record (None: only listed keys).
        source: ``metrics`` (its own chunks), ``trainer`` (accepted keys) or ``keys`` (listed records only).
    """

    name: str
    engine: str
    versions: list[int]
    groups: int
    tokens_per_s: float | None
    sync_s: float | None
    rejected: int | None
    quarantine: str
    last_seen_age_s: float | None
    source: str


def num(v: Any) -> float | None:
    """``v`` as a float when it is a finite int/float (never a bool), else None.

    Args:
        v: an untrusted value.
    """
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def version_of(v: Any) -> int | None:
    """``v`` as a policy version: a whole number in ``[0, 2**53)``, else None.

    Args:
        v: an untrusted value.
    """
    f = num(v)
    return int(f) if f is not None and 0 <= f < 2**53 and f == int(f) else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _col(rows: list[dict[str, Any]], name: str) -> list[float]:
    return [v for r in rows if (v := num(r.get(name))) is not None]


def training_view(snap: Snapshot, rows: list[dict[str, Any]]) -> None:
    """Fill the snapshot's trainer figures from the trainer's metrics rows (oldest first).

    Step rows are those with an integer ``step`` and ``rollout/reward_mean``; eval rows those with
    ``eval/accuracy`` or ``eval/cover_em``.

    Args:
        snap: the snapshot to fill (reward curve, steps/min, records/s, lag, rejections, evals).
        rows: the trainer's rows.
    """
    steps = [r for r in rows if type(r.get("step")) is int and "rollout/reward_mean" in r]
    snap.reward = [num(r.get("rollout/reward_mean")) for r in steps]
    snap.reward_steps = [r["step"] for r in steps]
    snap.step = steps[-1]["step"] if steps else None
    recent = steps[-RECENT_STEPS:]
    timed = [(r["step"], t) for r in recent if (t := num(r.get("time"))) is not None]
    if len(timed) >= 2 and timed[-1][1] > timed[0][1]:
        snap.steps_per_min = 60.0 * (timed[-1][0] - timed[0][0]) / (timed[-1][1] - timed[0][1])
    snap.records_per_s = _mean(_col(recent, "rollout/records_per_s"))
    lag: Counter[int] = Counter()
    rejected: Counter[str] = Counter()
    for r in recent:
        for k, v in r.items():
            tail = k[len("rollout/staleness/"):]
            if k.startswith("rollout/staleness/") and tail.isdigit() and len(tail) < 6 and (n := num(v)):
                lag[int(tail)] += int(n)
    for r in rows:
        for k, v in r.items():
            if k.startswith("rollout/rejected/") and (n := num(v)) and (k in rejected or len(rejected) < MAX_REASONS):
                rejected[k[len("rollout/rejected/"):][:64]] += int(n)
    snap.lag = {str(k): lag[k] for k in sorted(lag)}
    snap.rejected = dict(sorted(rejected.items()))
    snap.evals = eval_points(rows)
    quarantined = _col(steps[-1:], "quarantine/workers")
    snap.quarantined = int(quarantined[0]) if quarantined else 0


@dataclass
class _Seen:
    """What the listing and the trainer's accepted keys say about one worker."""

    versions: set[int] = field(default_factory=set)
    listed: int = 0
    accepted: int = 0
    last: float | None = None


def _seen(run_id: str, trainer_rows: list[dict[str, Any]], records: list[RolloutKey],
          cutoff: float) -> dict[str, _Seen]:
    seen: dict[str, _Seen] = {}
    for k in records:
        s = seen.setdefault(k.worker_id, _Seen())
        s.versions.add(k.version)
        s.listed += 1
    for r in trainer_rows:
        t, labels = num(r.get("time")), r.get("rollout/keys")
        if t is None or t < cutoff or not isinstance(labels, list):
            continue
        for label in labels:
            k = parse_rollout_key(run_id, rollouts_prefix(run_id) + label) if isinstance(label, str) else None
            if k is not None:
                s = seen.setdefault(k.worker_id, _Seen())
                s.accepted, s.last = s.accepted + 1, t if s.last is None else max(s.last, t)
                s.versions.add(k.version)
    return seen


def _worker_rows(chunks: list[_Chunk], reader: _Reader, cutoff: float) -> tuple[list[dict[str, Any]], str]:
    """The rows of a worker's newest chunks (its latest process only) and the engine it logged."""
    latest = [c for c in chunks if c.start == chunks[-1].start]
    rows: list[dict[str, Any]] = []
    for c in reversed(latest[-WORKER_CHUNKS:]):
        got = reader.rows(c.key, c.size)
        rows = got + rows
        if any(t < cutoff for t in _col(got, "time")):
            break
    engines = [e for r in rows if isinstance(e := r.get("worker/engine"), str)]
    if not engines and latest:
        engines = [e for r in reader.rows(latest[0].key, latest[0].size)
                   if isinstance(e := r.get("worker/engine"), str)]
    return rows, (engines[-1][:32] if engines else "")


def worker_views(run_id: str, trainer_rows: list[dict[str, Any]], records: list[RolloutKey],
                 chunks: dict[str, list[_Chunk]], reader: _Reader, quarantine: dict[str, tuple[int, str]], *,
                 cutoff: float, now: float) -> list[WorkerView]:
    """The workers seen since ``cutoff``: from their own metrics chunks when present, else from the keys.

    A worker counts as seen when it has a metrics row since ``cutoff``, a record the trainer accepted since
    then, or a listed record (retention keeps only the recent window).

    Args:
        run_id: the run id.
        trainer_rows: the trainer's metrics rows (``rollout/keys`` and their times).
        records: the listed rollout keys, parsed.
        chunks: metrics chunks per source.
        reader: reads (and counts) chunks.
        quarantine: per worker id, (rejected records, quarantine reason) from the trainer's journal.
        cutoff: start of the window (unix time).
        now: the snapshot's time (ages are measured from it).
    """
    seen = _seen(run_id, trainer_rows, records, cutoff)
    own = {s[len(WORKER_SOURCE):]: cs for s, cs in chunks.items() if s.startswith(WORKER_SOURCE)}
    names = set(seen) | {w for w, cs in own.items() if cs[-1].start >= cutoff}
    order = sorted(names, key=lambda w: -(seen[w].last or 0.0) if w in seen else -own[w][-1].start)
    views = []
    for i, name in enumerate(order):
        s = seen.get(name, _Seen())
        rows, engine = _worker_rows(own[name], reader, cutoff) if name in own and i < MAX_WORKERS else ([], "")
        window = [r for r in rows if (t := num(r.get("time"))) is not None and t >= cutoff]
        versions = s.versions | {v for r in window if (v := version_of(r.get("worker/version"))) is not None}
        times = _col(window, "time") + ([s.last] if s.last is not None else [])
        if not window and not s.accepted and not s.listed:
            continue
        source = "metrics" if window else "trainer" if s.accepted else "keys"
        groups = sum("worker/reward_mean" in r for r in window) if window else s.accepted or s.listed
        rejected, reason = quarantine.get(name, (None, ""))
        views.append(WorkerView(name, engine, [min(versions), max(versions)] if versions else [], groups,
                                _mean(_col(window, "worker/tokens_per_s")), _mean(_col(window, "worker/sync_s")),
                                rejected, reason, now - max(times) if times else None, source))
    return sorted(views, key=lambda v: v.name)
