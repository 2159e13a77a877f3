"""Worker quarantine: skip the records of a worker whose rejection rate or lag-0 logprob disagreement is high.

Two signals per worker id (the ``<worker>`` of ``runs/<run>/rollouts/v<version>/<worker>-<seq>.rec``):

- **rejection rate**: the fraction of its records rejected at intake, judged once it has sent
  ``min_records`` records.
- **lag-0 disagreement** (grail's statistic): for its records sampled at the trainer's current
  version, each completion token gives ``exp(|recorded - recomputed|) - 1`` between the worker's
  behaviour logprob and the trainer's recompute, which differ only by engine and weight-plane
  rounding for an honest worker. The worker is quarantined when the median over its lag-0 tokens
  exceeds the threshold, judged once ``min_records`` lag-0 records were seen.

- **sequential test** (``stoa.trainer.sequential``): a CUSUM over its records' scores, which catches a
  worker whose every record sits under the threshold but above what honest engines give, after enough records.
  Lag-0 records count as scored; a lagged record counts by its excess over the fleet's records at the same lag
  (``stoa.trainer.fleet``), and the fleet's lag-0 level calibrates the drift (``observe_step``).

The first two are kept over a bounded recent window (counts halve when the window fills), so memory and the
journal entry per worker are a handful of numbers. "Median above the threshold" is decided exactly
from two counts: more than half of the tokens are above it. Quarantine is sticky for the worker id.

The threshold is set for temperature 1 and full nucleus (``effective_threshold``): rounding errors of
the logits are divided by the temperature, so ``|d|`` allowed scales by ``1 / temperature``; with
``top_p < 1`` the worker's logprobs are renormalised over the nucleus, which the trainer does not
recompute, and ``exp|d|`` grows by at most ``1 / top_p``.

A worker id is chosen by the worker, so quarantine stops a broken or naive worker, not one that
changes its id: that is what record validation and the reuse cap are for.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stoa.identity import name_of
from stoa.schemas.journal import QuarantineRow
from stoa.trainer.fleet import DRIFT_FACTOR, FleetLevels, calibrated_drift
from stoa.trainer.sequential import Cusum, CusumParams, record_score

log = logging.getLogger(__name__)

STATE_VERSION = 1


def effective_threshold(disagreement: float, temperature: float = 1.0, top_p: float = 1.0) -> float:
    """The threshold on ``exp|d| - 1`` for a run: ``exp(log(1 + disagreement) / temperature) / top_p - 1``.

    Args:
        disagreement: the configured threshold (temperature 1, top_p 1).
        temperature: the run's sampling temperature.
        top_p: the run's nucleus mass.
    """
    return math.exp(math.log1p(disagreement) / temperature) / top_p - 1.0


def disagreement_values(recorded: np.ndarray, recomputed: np.ndarray) -> np.ndarray:
    """Per-token ``exp(|recorded - recomputed|) - 1`` (float64).

    Args:
        recorded: the worker's behaviour logprobs.
        recomputed: the trainer's logprobs of the same tokens at the same version.
    """
    d = np.abs(np.asarray(recorded, np.float64) - np.asarray(recomputed, np.float64))
    return np.expm1(d)


@dataclass
class Disagreement:
    """One worker's lag-0 tokens of one step.

    Args:
        values: ``exp|recorded - recomputed| - 1`` per lag-0 completion token.
        records: lag-0 records (groups) the tokens came from.
        per_record: every record's tokens, one array per record (empty: no sequential evidence).
        lags: each ``per_record`` entry's version lag (empty: all 0).
    """

    values: np.ndarray
    records: int
    per_record: tuple[np.ndarray, ...] = ()
    lags: tuple[int, ...] = ()

    def record_lags(self) -> tuple[int, ...]:
        """``lags``, or 0 for every record when unset."""
        return self.lags if self.lags else (0,) * len(self.per_record)

    @property
    def median(self) -> float:
        """Median of ``values`` (0 when empty)."""
        return float(np.median(self.values)) if self.values.size else 0.0


@dataclass
class _Worker:
    records: float = 0.0
    rejected: float = 0.0
    tokens: float = 0.0
    over: float = 0.0  # tokens above the threshold
    lag0_records: int = 0
    reason: str = ""  # "" (not quarantined), "reject_rate", "disagreement" or "sequential"
    cusum: float = 0.0

    def row(self) -> QuarantineRow:
        return QuarantineRow(self.records, self.rejected, self.tokens, self.over, self.lag0_records, self.reason,
                             self.cusum)


@dataclass
class _Since:
    """What happened since the last ``metrics()`` call."""

    new: int = 0
    medians: dict[str, float] = field(default_factory=dict)
    cusums: dict[str, float] = field(default_factory=dict)


class Quarantine:
    """Per worker id rejection rate and lag-0 logprob disagreement; decides whose records to skip.

    Args:
        enabled: False tracks and reports but never quarantines.
        disagreement: threshold on the median of ``exp|recorded - recomputed| - 1`` at temperature 1, top_p 1.
        reject_rate: quarantine once more than this fraction of a worker's records is rejected.
        min_records: records (lag-0 records for the disagreement) before a worker is judged.
        temperature: the run's sampling temperature (scales the threshold, see ``effective_threshold``).
        top_p: the run's nucleus mass (widens the threshold below 1).
        max_workers: worker ids tracked at most; the least recently seen are forgotten first,
            quarantined ones last.
        by_name: judge a worker by the name its key proves (a run with worker keys: ``<name>-<6 hex>`` counts as
            ``<name>``, ``stoa.identity.name_of``), so a process that restarts under a new id keeps its record.
        drift: the sequential test's reference per record at temperature 1, top_p 1 (None: no sequential test);
            with ``drift_floor`` the ceiling of the calibrated drift.
        evidence: the sequential test's limit (``sequential_params``).
        drift_floor: calibrate the drift from the fleet's lag-0 level (``stoa.trainer.fleet.calibrated_drift``)
            down to this, at temperature 1, top_p 1 (None: the drift stays ``drift``).
        max_lag: lagged records up to this lag give sequential evidence against the fleet's level at their lag.
        drift_factor: the calibrated drift over the fleet's lag-0 level (``quarantine_drift_factor``).
    """

    RECORD_WINDOW = 256
    TOKEN_WINDOW = 16384

    def __init__(self, *, enabled: bool, disagreement: float, reject_rate: float, min_records: int,
                 temperature: float = 1.0, top_p: float = 1.0, max_workers: int = 1024, by_name: bool = False,
                 drift: float | None = None, evidence: float = 1.0, drift_floor: float | None = None,
                 max_lag: int = 0, drift_factor: float = DRIFT_FACTOR):
        self.enabled, self.by_name = enabled, by_name
        self.threshold = effective_threshold(disagreement, temperature, top_p)
        self.reject_rate = reject_rate
        self.min_records = max(1, int(min_records))
        self.max_workers = max_workers
        self.sequential = (sequential_params(drift, evidence, disagreement, temperature, top_p)
                           if drift is not None else None)
        self.active = self.sequential
        """The test in force: ``sequential`` with the calibrated drift."""
        self.drift_floor = (None if drift_floor is None or self.sequential is None
                            else min(effective_threshold(drift_floor, temperature, top_p), self.sequential.drift))
        self.fleet = FleetLevels(max_lag, max_workers)
        self.drift_factor = drift_factor
        self.workers: collections.OrderedDict[str, _Worker] = collections.OrderedDict()
        self._since = _Since()

    def judged(self, worker_id: str) -> str:
        """Whom a record of ``worker_id`` counts for: its key's name (``by_name``), else the id itself.

        Args:
            worker_id: a record key's worker id.
        """
        return (name_of(worker_id) or worker_id) if self.by_name else worker_id

    def _touch(self, worker_id: str) -> _Worker:
        worker_id = self.judged(worker_id)
        w = self.workers.get(worker_id)
        if w is None:
            w = self.workers[worker_id] = _Worker()
            if len(self.workers) > self.max_workers:
                victim = next((k for k, v in self.workers.items() if not v.reason), next(iter(self.workers)))
                del self.workers[victim]
        self.workers.move_to_end(worker_id)
        return w

    def observe(self, worker_id: str, accepted: bool) -> None:
        """Count one record read from the bucket under this worker's key.

        Args:
            worker_id: the key's worker id.
            accepted: whether intake accepted it.
        """
        w = self._touch(worker_id)
        w.records += 1
        w.rejected += 0 if accepted else 1
        if w.records >= self.RECORD_WINDOW:
            w.records, w.rejected = w.records / 2, w.rejected / 2
        if w.records >= self.min_records and w.rejected > self.reject_rate * w.records:
            self._quarantine(self.judged(worker_id), w, "reject_rate",
                             f"{w.rejected / w.records:.2f} of its records rejected (> {self.reject_rate})")

    def observe_disagreement(self, worker_id: str, stats: Disagreement) -> None:
        """Add one step's lag-0 tokens and records (any lag) of a worker; ``observe_step`` adds a whole step's.

        Args:
            worker_id: the worker (see ``stoa.trainer.step.train_step``).
            stats: its lag-0 values and its records of this step.
        """
        values = np.asarray(stats.values, np.float64)
        if values.size == 0 and not stats.per_record:
            return
        w, judged = self._touch(worker_id), self.judged(worker_id)
        if values.size:
            self._observe_tokens(judged, w, values, int(stats.records))
        self._observe_records(judged, w, stats)

    def _observe_tokens(self, worker_id: str, w: _Worker, values: np.ndarray, records: int) -> None:
        """Count a step's lag-0 tokens over the threshold; quarantine the worker when most of its recent ones are."""
        w.tokens += values.size
        # NaN (a recompute that overflowed) counts as over the threshold.
        w.over += int(values.size - np.count_nonzero(values <= self.threshold))
        w.lag0_records += records
        while w.tokens > self.TOKEN_WINDOW:
            w.tokens, w.over = w.tokens / 2, w.over / 2
        self._since.medians[worker_id] = float(np.median(values))
        if w.lag0_records >= self.min_records and w.over > w.tokens / 2:
            self._quarantine(worker_id, w, "disagreement",
                             "median exp|recorded - recomputed logprob| - 1 over its lag-0 tokens > "
                             f"{self.threshold:.4g} "
                             f"({w.over / w.tokens:.2f} of {w.tokens:.0f} tokens above; this step's median "
                             f"{self._since.medians[worker_id]:.4g})")

    def wants_rounding(self, step: int) -> bool:
        """Whether ``train_step`` should probe the trainer's rounding at ``step`` (``stoa.trainer.fleet``): only while
        the drift is calibrated.

        Args:
            step: the optimizer step about to be taken.
        """
        return self.sequential is not None and self.drift_floor is not None and self.fleet.wants_probe(step)

    def observe_step(self, stats: dict[str, Disagreement], rounding: Sequence[float] = ()) -> None:
        """Add one step's records of every worker: first to the fleet's levels (every worker's, so each lagged
        record is judged against the same step's fleet), then recalibrate the drift, then judge each worker
        (``observe_disagreement``).

        Args:
            stats: per worker id, its records of the step (``stoa.trainer.step.train_step``).
            rounding: the step's rounding probes (``StepMetrics.rounding``), the drift's floor from the model itself.
        """
        self.fleet.advance()
        for score in rounding:
            self.fleet.add_rounding(score)
        for worker_id, s in stats.items():
            for values, lag in zip(s.per_record, s.record_lags(), strict=True):
                self.fleet.add(self.judged(worker_id), lag, record_score(values, math.inf))
        if self.sequential is not None and self.drift_floor is not None:
            drift = calibrated_drift(self.fleet, self.drift_floor, self.sequential.drift, self.drift_factor)
            s0 = self.sequential
            self.active = CusumParams(drift=drift, limit=max(s0.limit, s0.cap - drift), cap=s0.cap)
        for worker_id, s in stats.items():
            self.observe_disagreement(worker_id, s)

    def _observe_records(self, worker_id: str, w: _Worker, stats: Disagreement) -> None:
        """Feed each record's score to the worker's CUSUM (a lagged one shifted by the fleet's levels, skipped
        without them); quarantine the worker when the sum passes the limit."""
        p = self.active
        if p is None or not stats.per_record:
            return
        c, lagged = Cusum(w.cusum), 0
        for values, lag in zip(stats.per_record, stats.record_lags(), strict=True):
            score = record_score(values, p.cap) if lag == 0 else self.fleet.shifted(
                worker_id, lag, record_score(values, math.inf))
            if score is not None:
                c, lagged = c.update(score, p), lagged + (lag > 0)
        w.cusum = c.value
        self._since.cusums[worker_id] = c.value
        if c.alarm(p):
            self._quarantine(worker_id, w, "sequential",
                             f"CUSUM of its records' median exp|recorded - recomputed logprob| - 1 (lagged ones "
                             f"over the fleet's at their lag) minus {p.drift:.4g} reached {c.value:.4g} (> "
                             f"{p.limit:.4g}) after {w.lag0_records} lag-0 records and {lagged} lagged ones this step")

    def _quarantine(self, worker_id: str, w: _Worker, reason: str, detail: str) -> None:
        if not self.enabled or w.reason:
            return
        w.reason = reason
        self._since.new += 1
        log.warning("quarantined worker %s (%s): %s; its records are skipped from now on",
                    worker_id, reason, detail)

    def is_quarantined(self, worker_id: str) -> bool:
        """Whether this worker's records are to be skipped.

        Args:
            worker_id: the key's worker id.
        """
        w = self.workers.get(self.judged(worker_id))
        return bool(self.enabled and w is not None and w.reason)

    def state(self) -> dict[str, Any]:
        """JSON-able state for the trainer journal (per worker: a few counts and the quarantine reason)."""
        seq = self.sequential
        out = {"v": STATE_VERSION, "threshold": self.threshold,
               "workers": {k: w.row().to_json() for k, w in self.workers.items()}}
        if seq is not None:
            out["sequential"] = [seq.drift, seq.limit, seq.cap]
        return out

    def restore(self, state: dict[str, Any]) -> None:
        """Restore what ``state()`` returned; malformed entries are dropped, token counts kept only
        when the threshold they were counted against is the same, CUSUM sums only when the test is.

        Args:
            state: a journal entry (``{}`` starts empty).
        """
        self.workers.clear()
        same = _num(state.get("threshold")) == self.threshold if isinstance(state, dict) else False
        seq = self.sequential
        same_seq = (seq is not None and isinstance(state, dict)
                    and state.get("sequential") == [seq.drift, seq.limit, seq.cap])
        rows = state.get("workers", {}) if isinstance(state, dict) else {}
        for wid, row in (rows.items() if isinstance(rows, dict) else ()):
            q = QuarantineRow.parse(row) if isinstance(wid, str) else None
            if q is None:
                continue
            tokens, over = (q.tokens, q.over) if same else (0.0, 0.0)  # else counted against another threshold
            self.workers[wid] = _Worker(q.records, min(q.rejected, q.records), tokens, min(over, tokens),
                                        int(q.lag0_records), q.reason, float(q.cusum) if same_seq else 0.0)
        while len(self.workers) > self.max_workers:
            self.workers.popitem(last=False)

    def metrics(self) -> dict[str, float]:
        """Gauges and counts since the last call: ``quarantine/workers`` (quarantined ids),
        ``quarantine/new``, ``quarantine/tracked``, ``quarantine/disagreement/<worker>`` (median of the
        worker's lag-0 values in its latest step, per worker seen since the last call),
        ``quarantine/disagreement_max``, ``quarantine/cusum/<worker>`` (its sequential test's sum, per worker seen
        since the last call) and ``quarantine/cusum_max`` (their largest; the limit is ``sequential.limit``).
        Skipped records are the pool's to count (``rollout/rejected/quarantined``)."""
        s, self._since = self._since, _Since()
        quarantined = sum(1 for w in self.workers.values() if w.reason) if self.enabled else 0
        out = {"quarantine/workers": float(quarantined),
               "quarantine/tracked": float(len(self.workers)), "quarantine/new": float(s.new),
               "quarantine/disagreement_max": max(s.medians.values(), default=0.0)}
        out.update({f"quarantine/disagreement/{k}": v for k, v in s.medians.items()})
        if self.active is not None:
            out["quarantine/drift"] = self.active.drift
            out["quarantine/cusum_max"] = max(s.cusums.values(), default=0.0)
            out.update({f"quarantine/cusum/{k}": v for k, v in s.cusums.items()})
        return out


def sequential_params(drift: float, evidence: float, disagreement: float, temperature: float = 1.0,
                      top_p: float = 1.0) -> CusumParams:
    """The run's CUSUM: ``drift`` and the cap (``disagreement``) scaled to the run's sampling like the threshold
    (``effective_threshold``), the limit ``evidence`` scaled by the temperature's factor on the cap.

    Args:
        drift: reference per record at temperature 1, top_p 1 (``quarantine_drift``).
        evidence: the limit at temperature 1 (``quarantine_evidence``).
        disagreement: the per-step threshold, each record's largest score (``quarantine_disagreement``).
        temperature: the run's sampling temperature.
        top_p: the run's nucleus mass.
    """
    scale = effective_threshold(disagreement, temperature) / disagreement
    return CusumParams(drift=effective_threshold(drift, temperature, top_p), limit=evidence * scale,
                       cap=effective_threshold(disagreement, temperature, top_p))


def _num(x: Any) -> float | None:
    """A finite number from JSON, else None."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) else None
