"""A mixed fleet: honest workers of one engine pair judged with the drift a majority of another pair calibrates.

The trainer calibrates its CUSUM drift from the fleet's lag-0 level (the median over workers,
``stoa.trainer.fleet.calibrated_drift``), so in a fleet of mostly quiet workers (say fp32 torch boxes) a minority on
a noisier engine (bf16 workers, Macs) is judged against the quiet majority's level. When the minority's mean record
score is over that drift, its honest workers' sums climb and they are quarantined. For each trainer recompute, this
table puts every pair of the run as the majority (it sets the drift, through the trainer's own calibration) and every
other pair as the minority: streams of ``horizon`` records drawn with replacement from the minority's measured record
scores run a fresh CUSUM each. The trainer's rounding probes (``stoa.trainer.rounding``), when the run measured them,
floor the drift as in the trainer. Drawing with replacement from a few hundred records is an approximation of a longer
run (it repeats the measured spread, not its tails). Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stoa.trainer.fleet import DRIFT_FACTOR, MIN_RECORDS, FleetLevels, calibrated_drift
from stoa.trainer.sequential import CusumParams, run_length

FLEET = 8
"""Majority workers the majority's records are dealt into (the calibration needs at least three)."""


@dataclass(frozen=True)
class MinorityRow:
    """Honest minority workers in a fleet whose majority sets the drift.

    Args:
        majority: the pair that calibrates the drift.
        minority: the pair judged.
        drift: the calibrated drift.
        minority_mean: the minority's mean record score.
        streams: minority workers simulated.
        horizon: records each.
        quarantined: workers whose CUSUM alarmed within the horizon.
        median_records: median records to the false alarm (0: none).
    """

    majority: str
    minority: str
    drift: float
    minority_mean: float
    streams: int
    horizon: int
    quarantined: int
    median_records: float


def run_of(pair: str) -> str:
    """The run a pair label (``worker / plane / trainer``) belongs to: its plane and trainer recompute (one per run)."""
    return pair.split(" / ", 1)[-1]


def majority_drift(scores: np.ndarray, floor: float, ceiling: float, rounding: np.ndarray | None = None,
                   factor: float = DRIFT_FACTOR) -> float:
    """The trainer's calibrated drift over a fleet of ``FLEET`` workers holding ``scores`` (dealt round-robin), with
    the trainer's rounding probes ``rounding`` (None: none).

    Args:
        scores: the majority's record scores.
        floor: ``quarantine_drift_floor`` at the run's sampling.
        ceiling: ``quarantine_drift`` at the run's sampling.
        rounding: the run's rounding probe scores (``Rig.rounding``).
        factor: ``quarantine_drift_factor``.
    """
    fleet = FleetLevels(0)
    for x in () if rounding is None else rounding:
        fleet.add_rounding(float(x))
    for i, x in enumerate(scores):
        fleet.add(f"fleet{i % FLEET}", 0, float(x))
    if len(scores) < FLEET * MIN_RECORDS:
        raise ValueError(f"a majority needs {FLEET * MIN_RECORDS} records to calibrate, got {len(scores)}")
    return calibrated_drift(fleet, floor, ceiling, factor)


def minority_rows(honest: dict[str, np.ndarray], ceiling: CusumParams, floor: float, horizon: int, streams: int,
                  seed: int, rounding: dict[str, np.ndarray] | None = None,
                  factor: float = DRIFT_FACTOR) -> list[MinorityRow]:
    """Every ordered pair (majority, minority) of engine pairs with the same plane and trainer recompute.

    Args:
        honest: record scores per engine pair label.
        ceiling: the uncalibrated test (its drift is the ceiling; its limit and cap are kept).
        floor: the drift's floor.
        horizon: records per minority worker.
        streams: minority workers simulated per row.
        seed: resampling seed.
        rounding: the trainer's rounding probes by plane label (the drift's floor; None or a plane missing: none).
        factor: ``quarantine_drift_factor``.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for major, m_scores in honest.items():
        if len(m_scores) < FLEET * MIN_RECORDS:
            continue
        plane = run_of(major).split(" / ", 1)[0]
        drift = majority_drift(m_scores, floor, ceiling.drift, (rounding or {}).get(plane), factor)
        params = CusumParams(drift, max(ceiling.limit, ceiling.cap - drift), ceiling.cap)
        for minor, s in honest.items():
            if minor == major or run_of(minor) != run_of(major) or not len(s):
                continue
            runs = [run_length(rng.choice(s, horizon), params) for _ in range(streams)]
            hits = [r for r in runs if r]
            rows.append(MinorityRow(major, minor, drift, float(np.mean(s)), streams, horizon, len(hits),
                                    float(np.median(hits)) if hits else 0.0))
    return rows


def table(rows: list[MinorityRow]) -> list[str]:
    """Markdown table of the rows (empty without any)."""
    if not rows:
        return []
    lines = ["| majority (calibrates the drift) | honest minority | drift | minority mean | false quarantines | "
             "median records to it |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r.majority} | {r.minority} | {r.drift:.4f} | {r.minority_mean:.4f} | {r.quarantined}/{r.streams} "
              f"(within {r.horizon}) | {r.median_records:g} |" for r in rows]
    return lines
