"""`stoa bench verify`'s mixed-fleet table: an honest minority on a noisier engine, judged with the drift a quiet
majority calibrates, is counted as falsely quarantined when its mean is over that drift, and not otherwise; pairs of
other runs (plane, trainer) never meet."""

from __future__ import annotations

import numpy as np
import pytest

from stoa.bench.verify.minority import majority_drift, minority_rows, run_of, table
from stoa.trainer.fleet import DRIFT_FACTOR
from stoa.trainer.sequential import CusumParams

CEILING = CusumParams(0.065, 0.3, 0.15)


def scores(mean: float, std: float, n: int = 256, seed: int = 0) -> np.ndarray:
    return np.abs(np.random.default_rng(seed).normal(mean, std, n))


def test_the_majority_sets_the_drift_through_the_trainers_calibration() -> None:
    quiet = scores(0.008, 0.001)
    assert majority_drift(quiet, 0.005, 0.065) == pytest.approx(DRIFT_FACTOR * quiet.mean(), rel=0.05)
    assert majority_drift(scores(0.001, 0.0001), 0.005, 0.065) == 0.005  # the floor
    assert majority_drift(scores(0.05, 0.001), 0.005, 0.065) == 0.065  # the ceiling
    with pytest.raises(ValueError, match="needs 32 records"):
        majority_drift(quiet[:10], 0.005, 0.065)


def test_a_minority_over_the_calibrated_drift_is_counted_and_one_under_it_is_not() -> None:
    quiet = scores(0.008, 0.003)
    over = scores(1.2 * DRIFT_FACTOR * 0.008, 0.005, seed=1)
    under = scores(0.6 * DRIFT_FACTOR * 0.008, 0.005, seed=2)
    honest = {"a fp32 / bf16 / fp32": quiet, "a bf16 / bf16 / fp32": over, "b bf16 / bf16 / fp32": under,
              "a bf16 / bf16 / bf16": over, "a fp32 / int8g64 / fp32": over}
    rows = minority_rows(honest, CEILING, 0.005, horizon=1000, streams=20, seed=0)
    by = {(r.majority, r.minority): r for r in rows}
    hit = by[("a fp32 / bf16 / fp32", "a bf16 / bf16 / fp32")]
    assert hit.quarantined == 20 and 0 < hit.median_records < 1000
    assert by[("a fp32 / bf16 / fp32", "b bf16 / bf16 / fp32")].quarantined == 0
    assert all(run_of(r.majority) == run_of(r.minority) for r in rows)  # other planes and trainers never meet
    assert ("a fp32 / bf16 / fp32", "a bf16 / bf16 / bf16") not in by
    assert len(table(rows)) == 2 + len(rows) and table([]) == []
