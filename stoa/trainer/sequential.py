"""Per-worker sequential test (a one-sided CUSUM) on the recompute residuals: catches mild, persistent lies.

Quarantine's per-step threshold (``stoa.trainer.quarantine``) judges a worker by the median residual of its recent
tokens, so a worker whose every record sits just under it (sampling at T x 0.8, logprob noise N(0, 0.1), 2% weight
noise: docs/verification.md) is never caught. This test accumulates evidence over the worker's records instead.

Each lag-0 record (a group) gives one **score**: the median over its action tokens of ``exp|recorded -
recomputed| - 1`` (the statistic quarantine and the recompute check use), clipped to ``[0, cap]``, a non-finite
median counting as ``cap``. Per worker the trainer keeps Page's CUSUM

    ``S_0 = 0``,  ``S_n = max(0, S_{n-1} + score_n - drift)``

and quarantines the worker when ``S_n > limit``. ``drift`` (the reference value) sits above the honest mean score
of every engine pair measured for the model's plane and below the mild lies', so an honest worker's sum keeps
falling back to 0 while a persistent liar's climbs by ``mean score - drift`` a record. Each record moves the sum
by at most ``cap - drift`` up and ``drift`` down, so no single record (a huge residual, a NaN, an infinity) can
quarantine a worker, and none can wipe more than ``drift`` of a liar's evidence: it takes at least
``limit / (cap - drift)`` records to quarantine anyone. Gross lies stay the per-step threshold's.

The trainer does not know a worker's engine (a worker says what it runs, which proves nothing), so ``drift`` is
one value per run that must hold for the noisiest honest engine pair of the run's model and plane; the trainer
calibrates it from the fleet's lag-0 level, and a lagged record enters the sum shifted by the fleet's level at its
lag (``stoa.trainer.fleet``). ``stoa bench verify`` measures the honest scores per pair, the false-quarantine rate
and the records each attack takes to be caught. This module imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Cusum", "CusumParams", "record_score"]


@dataclass(frozen=True)
class CusumParams:
    """One run's sequential test, in units of ``exp|recorded - recomputed| - 1`` (after temperature/top_p scaling).

    Args:
        drift: reference value subtracted from every record's score (above honest means, below mild lies').
        limit: quarantine once the sum exceeds this (at least ``cap - drift``: no single record reaches it).
        cap: largest score one record counts for (its contribution is at most ``cap - drift``).
    """

    drift: float
    limit: float
    cap: float

    def __post_init__(self) -> None:
        if not (0 < self.drift < self.cap and self.cap - self.drift <= self.limit < math.inf):
            raise ValueError(f"CUSUM needs 0 < drift < cap and cap - drift <= limit < inf (no single record "
                             f"quarantines), got drift {self.drift}, cap {self.cap}, limit {self.limit}")

    @property
    def min_records(self) -> int:
        """Fewest records that can take a sum from 0 over ``limit``."""
        return math.floor(self.limit / (self.cap - self.drift)) + 1


def record_score(values: np.ndarray, cap: float) -> float:
    """One record's score: the median of its tokens' ``exp|recorded - recomputed| - 1``, clipped to ``[0, cap]``.

    A record without tokens scores 0 (it adds no evidence); a NaN token counts as the worst token, so a NaN or
    infinite median counts as ``cap``.

    Args:
        values: the record's per-token values (any float array).
        cap: the largest score.
    """
    v = np.asarray(values, np.float64).ravel()
    if v.size == 0:
        return 0.0
    v = np.where(np.isnan(v), np.inf, v)  # a NaN token is as bad as the worst, never better
    m = float(np.median(v))
    if not math.isfinite(m):
        return cap
    return min(max(m, 0.0), cap)


@dataclass(frozen=True)
class Cusum:
    """One worker's CUSUM state.

    Args:
        value: the current sum ``S_n`` (>= 0).
        records: records scored so far.
    """

    value: float = 0.0
    records: int = 0

    def update(self, score: float, params: CusumParams) -> Cusum:
        """The state after one more record; ``score`` is clipped to ``[0, cap]`` (NaN counts as ``cap``).

        Args:
            score: the record's score (``record_score``).
            params: the run's test.
        """
        s = params.cap if math.isnan(score) else min(max(score, 0.0), params.cap)
        return Cusum(max(0.0, self.value + s - params.drift), self.records + 1)

    def alarm(self, params: CusumParams) -> bool:
        """Whether the sum is over ``limit``.

        Args:
            params: the run's test.
        """
        return self.value > params.limit


def run_length(scores: np.ndarray, params: CusumParams) -> int:
    """Records until the first alarm of a fresh CUSUM fed ``scores`` in order (1-based); 0 when none alarms.

    Args:
        scores: per-record scores.
        params: the test.
    """
    c = Cusum()
    for i, s in enumerate(np.asarray(scores, np.float64)):
        c = c.update(float(s), params)
        if c.alarm(params):
            return i + 1
    return 0
