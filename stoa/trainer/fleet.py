"""The fleet's honest residual level per version lag: what the sequential test compares a worker's records with.

At lag 0 a record's score (``stoa.trainer.sequential.record_score``) measures only engine and plane rounding. At lag
``k >= 1`` the worker sampled with weights ``k`` versions older than the trainer's, which the trainer no longer
holds, so the score also holds how far the policy moved in ``k`` steps: the honest level grows with the lag and with
the learning rate, and no fixed reference fits it. Every worker's lag-``k`` records of the same steps share that
movement, so the **fleet level** at lag ``k`` (the median over workers of each worker's mean recent score at that
lag, each score clipped to ``SCORE_CLIP``) is the honest reference: a lag-``k`` record enters the worker's CUSUM
as ``score - level_k + level_0``, the score an honest lag-0 record of the fleet would have plus the record's
excess over the fleet at its lag (``Quarantine.observe_step``). The trainer computes these scores from the
logprobs its step computes anyway.

The same levels **calibrate the drift** (``calibrated_drift``): ``DRIFT_FACTOR`` x the fleet's lag-0 level, between
``quarantine_drift_floor`` and ``quarantine_drift`` (the ceiling, used until the fleet is large enough), and never
under ``ROUNDING_FACTOR`` x the trainer's own **rounding level**: how far bf16 rounding alone moves this model's
logprobs, from the trainer's fp32 and bf16 forwards of one of its groups (``FleetLevels.add_rounding``). The fleet's
level is a median, so in a fleet of mostly fp32 workers it is theirs, and an honest minority on bf16 engines scores
more than ``DRIFT_FACTOR`` x it on some models (SmolLM2-135M with an fp32 trainer: 0.0215 against 0.0083,
docs/verification.md); the rounding level is a property of the model the trainer computes itself, which no worker
can move.

At lag ``k >= 1`` the level uses the records of the last ``RECENT_STEPS`` steps only: the policy's movement per
step changes over a run (the gradients' size, the optimizer's moments), and a level that lagged behind a growing
movement would put every honest worker over it. The lag-0 level (rounding, steady) uses the whole window.

A median over workers is a vote: it holds while fewer than half the workers with records at a lag lie. So a level
needs ``MIN_WORKERS`` workers (the judged one excluded for its own shift): with fewer, lagged records give no
evidence and the drift stays at its ceiling. Memory: ``WINDOW`` scores per worker and lag, for ``max_workers``
workers. Imports no torch.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

__all__ = ["DRIFT_FACTOR", "ROUNDING_FACTOR", "FleetLevels", "calibrated_drift"]

DRIFT_FACTOR = 2.5
"""Drift over the fleet's lag-0 level (the default of ``quarantine_drift_factor``): covers a worker on the noisiest
engine of the fleet (bf16 workers score about twice what fp32 workers do on the tiny model, docs/verification.md)
while a fleet-level worker's sum falls."""

WINDOW = 64
"""Recent record scores kept per worker and lag."""

MIN_RECORDS = 4
"""Scores a worker needs at a lag before its mean counts towards the level."""

SCORE_CLIP = 1.0
"""Largest score a record adds to its worker's mean (a worker's own outlier moves only its own vote)."""

RECENT_STEPS = 4
"""Steps a lagged level looks back (``FleetLevels.advance`` counts them)."""

MIN_WORKERS = 2
"""Workers a level needs (other than the judged one): with two, one liar cannot set it alone."""

ROUNDING_FACTOR = 1.75
"""Drift over the trainer's rounding level (``FleetLevels.rounding_level``): an honest worker that computes in the other
precision than the trainer scores about that level plus its engine's own decode (against an fp32 trainer on
SmolLM2-135M, rounding level 0.0171: torch bf16 workers 0.0215, MLX bf16 ones 0.0231, 1.35x; the rest is margin for
engines not measured, such as CUDA and Metal)."""

PROBE_EVERY = 8
"""Steps between the trainer's rounding probes once it has ``MIN_RECORDS`` of them (every step before)."""


@dataclass(frozen=True)
class Level:
    """The fleet's level at one lag.

    Args:
        value: median over workers of their mean recent score (a mean, as the CUSUM sums: skewed honest scores at
            a high lag have a mean over their median, which a median level would count as excess).
        workers: workers it came from.
    """

    value: float
    workers: int


class FleetLevels:
    """Recent record scores per lag and worker; the fleet's median level per lag.

    Args:
        max_lag: the largest lag tracked (the staleness bound).
        max_workers: workers tracked per lag; the least recently seen are forgotten first.
    """

    def __init__(self, max_lag: int, max_workers: int = 1024):
        self.max_lag, self.max_workers, self.step = max_lag, max_workers, 0
        self.scores: list[collections.OrderedDict[str, collections.deque[tuple[int, float]]]] = [
            collections.OrderedDict() for _ in range(max_lag + 1)]
        self.rounding: collections.deque[float] = collections.deque(maxlen=WINDOW)
        """The trainer's own rounding probes (record scores of its fp32 against its bf16 logprobs)."""

    def advance(self) -> None:
        """Start the next step: records added from now on are newer than those before."""
        self.step += 1

    def add(self, worker: str, lag: int, score: float) -> None:
        """Keep one record's score (a lag outside ``[0, max_lag]`` or a non-finite score is ignored).

        Args:
            worker: whom the record counts for.
            lag: its version lag.
            score: its score (``record_score``).
        """
        if not 0 <= lag <= self.max_lag or not np.isfinite(score):
            return
        by_worker = self.scores[lag]
        q = by_worker.get(worker)
        if q is None:
            q = by_worker[worker] = collections.deque(maxlen=WINDOW)
            if len(by_worker) > self.max_workers:
                by_worker.popitem(last=False)
        by_worker.move_to_end(worker)
        q.append((self.step, min(float(score), SCORE_CLIP)))

    def add_rounding(self, score: float) -> None:
        """Keep one rounding probe's score (a non-finite one is ignored).

        Args:
            score: ``record_score`` of the trainer's fp32 against its bf16 logprobs of one group.
        """
        if np.isfinite(score):
            self.rounding.append(min(float(score), SCORE_CLIP))

    def rounding_level(self) -> float | None:
        """The mean of the rounding probes (None with under ``MIN_RECORDS``)."""
        return float(np.mean(self.rounding)) if len(self.rounding) >= MIN_RECORDS else None

    def wants_probe(self, step: int) -> bool:
        """Whether the trainer should probe its rounding at ``step``: every step until it has ``MIN_RECORDS``
        probes, then every ``PROBE_EVERY`` steps.

        Args:
            step: the optimizer step about to be taken.
        """
        return len(self.rounding) < MIN_RECORDS or step % PROBE_EVERY == 0

    def level(self, lag: int, exclude: str | None = None) -> Level | None:
        """The fleet's level at ``lag`` over the workers other than ``exclude`` (their records of the last
        ``RECENT_STEPS`` steps at a lag >= 1); None with under ``MIN_WORKERS`` workers of ``MIN_RECORDS`` records.

        Args:
            lag: the version lag.
            exclude: the judged worker (its own records never set its reference).
        """
        if not 0 <= lag <= self.max_lag:
            return None
        since = self.step - RECENT_STEPS + 1 if lag else -1
        recent = ([x for t, x in q if t >= since] for w, q in self.scores[lag].items() if w != exclude)
        meds = [float(np.mean(xs)) for xs in recent if len(xs) >= MIN_RECORDS]
        if len(meds) < MIN_WORKERS:
            return None
        return Level(float(np.median(meds)), len(meds))

    def shifted(self, worker: str, lag: int, score: float) -> float | None:
        """A lag-``lag`` record's score on the lag-0 scale: ``score - level_lag + level_0`` (the levels over the
        other workers); the score itself at lag 0; None when a level is missing (no evidence).

        Args:
            worker: whom the record counts for.
            lag: its version lag.
            score: its score.
        """
        if lag == 0:
            return score
        at, base = self.level(lag, worker), self.level(0, worker)
        if at is None or base is None:
            return None
        return score - at.value + base.value


def calibrated_drift(fleet: FleetLevels, floor: float, ceiling: float, factor: float = DRIFT_FACTOR) -> float:
    """The run's drift: ``factor`` x the fleet's lag-0 level (all workers), or ``ROUNDING_FACTOR`` x the trainer's
    rounding level when that is more, clipped to ``[floor, ceiling]``; the ceiling until ``MIN_WORKERS + 1`` workers
    have ``MIN_RECORDS`` lag-0 records.

    Args:
        fleet: the levels.
        floor: the smallest drift (``quarantine_drift_floor``).
        ceiling: the largest (``quarantine_drift``).
        factor: the drift over the fleet's level (``quarantine_drift_factor``).
    """
    lv = fleet.level(0)
    if lv is None or lv.workers < MIN_WORKERS + 1:
        return ceiling
    rounding = fleet.rounding_level()
    anchor = max(factor * lv.value, 0.0 if rounding is None else ROUNDING_FACTOR * rounding)
    return float(min(max(anchor, floor), ceiling))
