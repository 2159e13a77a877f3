"""The fleet's levels per lag (stoa.trainer.fleet) and the sequential test on lagged records: a worker whose lagged
logprobs lie is caught by its excess over the other workers at its lag, honest workers whose residuals grow with
the lag are not, and the drift calibrates itself from the fleet's lag-0 level between its floor and ceiling."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stoa.trainer.fleet import DRIFT_FACTOR, MIN_RECORDS, SCORE_CLIP, WINDOW, FleetLevels, Level, calibrated_drift
from stoa.trainer.quarantine import Disagreement, Quarantine

lv0 = Level(0.0, 0)


def value(f: FleetLevels, lag: int, exclude: str | None = None) -> float:
    lv = f.level(lag, exclude)
    assert lv is not None
    return lv.value


def drift(q: Quarantine) -> float:
    assert q.active is not None
    return q.active.drift


def test_a_level_is_the_median_over_other_workers_of_their_medians():
    f = FleetLevels(max_lag=3)
    for x in (0.01, 0.02, 0.03, 0.04):
        f.add("a", 1, x)  # median 0.025
        f.add("b", 1, 10 * x)  # median 0.25: a liar's scores move the level by one vote, not by their size
        f.add("c", 1, x / 2)  # median 0.0125
    assert value(f, 1) == pytest.approx(0.025) and (f.level(1) or lv0).workers == 3
    assert value(f, 1, "a") == pytest.approx((0.25 + 0.0125) / 2)  # its own records never count
    assert value(f, 1, "b") == pytest.approx((0.025 + 0.0125) / 2)
    f.add("d", 2, 0.5)
    assert f.level(2) is None  # one worker, too few records: no level, no evidence
    assert f.level(4) is None and f.level(-1) is None
    f.add("a", 9, 1.0)
    f.add("a", 1, math.nan)
    f.add("a", 1, math.inf)  # outside the lags or not finite: ignored
    assert len(f.scores[1]["a"]) == MIN_RECORDS
    for _ in range(2 * WINDOW):
        f.add("a", 1, 1.0)
    assert len(f.scores[1]["a"]) == WINDOW and value(f, 1, "b") == pytest.approx((1.0 + 0.0125) / 2)


def test_a_lagged_score_is_shifted_to_the_lag_0_scale_by_the_other_workers_levels():
    f = FleetLevels(max_lag=2)
    for w, at0, at2 in (("a", 0.004, 0.09), ("b", 0.003, 0.08), ("c", 0.005, 0.10)):
        for _ in range(MIN_RECORDS):
            f.add(w, 0, at0)
            f.add(w, 2, at2)
    assert f.shifted("judged", 2, 0.16) == pytest.approx(0.16 - 0.09 + 0.004)
    assert f.shifted("a", 2, 0.09) == pytest.approx(0.09 - 0.09 + 0.004)  # over b and c: (0.08+0.10)/2, (0.003+0.005)/2
    assert f.shifted("judged", 0, 0.02) == 0.02
    assert f.shifted("judged", 1, 0.16) is None  # nobody else at lag 1


def test_the_drift_is_the_fleets_lag_0_level_times_the_factor_between_floor_and_ceiling():
    f = FleetLevels(max_lag=0)
    for w in ("a", "b"):
        for _ in range(MIN_RECORDS):
            f.add(w, 0, 0.0034)
    assert calibrated_drift(f, 0.005, 0.065) == 0.065  # two workers: one of them could be the liar it fits
    for _ in range(MIN_RECORDS):
        f.add("c", 0, 0.0034)
    assert calibrated_drift(f, 0.005, 0.065) == pytest.approx(DRIFT_FACTOR * 0.0034)
    assert calibrated_drift(f, 0.01, 0.065) == 0.01
    assert calibrated_drift(f, 0.001, 0.005) == 0.005
    assert calibrated_drift(f, 0.001, 0.065, factor=1.5) == pytest.approx(1.5 * 0.0034)  # quarantine_drift_factor
    q = Quarantine(enabled=True, disagreement=0.15, reject_rate=0.5, min_records=8, drift=0.065, evidence=0.3,
                   drift_floor=0.001, drift_factor=1.5)
    q.observe_step({w: Disagreement(np.full(8, 0.0034), 1, (np.full(8, 0.0034),) * MIN_RECORDS, (0,) * MIN_RECORDS)
                    for w in ("a", "b", "c")})
    assert q.active is not None and q.active.drift == pytest.approx(1.5 * 0.0034)


def q_with(**kw) -> Quarantine:
    args = {"enabled": True, "disagreement": 0.15, "reject_rate": 0.5, "min_records": 8, "drift": 0.065,
            "evidence": 0.3, "drift_floor": 0.005, "max_lag": 3} | kw
    return Quarantine(**args)


def records(rng: np.random.Generator, level: float, n: int, lag: int, tokens: int = 24) -> Disagreement:
    """``n`` records at ``lag`` whose token values scatter around ``level``."""
    per = tuple(np.abs(rng.normal(level, level / 4 + 1e-4, tokens)) for _ in range(n))
    return Disagreement(np.concatenate(per) if lag == 0 else np.zeros(0), n if lag == 0 else 0, per, (lag,) * n)


HONEST = {0: 0.0035, 1: 0.07, 2: 0.08, 3: 0.11}
"""Honest record levels per lag (the tiny model's lag 0; lags 1-3 as after Adam steps of lr 1e-3)."""


@pytest.mark.parametrize("lag", [1, 2])
def test_a_liar_at_lag_k_is_caught_by_its_excess_honest_workers_at_lags_1_to_3_never(lag):
    rng, q = np.random.default_rng(lag), q_with()
    workers = ["h1", "h2", "h3", "liar"]
    for _ in range(3):  # lag-0 records calibrate the drift: 2.5 x 0.0035 = 0.00875
        q.observe_step({w: records(rng, HONEST[0], 4, 0) for w in workers})
    assert drift(q) == pytest.approx(DRIFT_FACTOR * HONEST[0], rel=0.1)
    caught = 0
    for step in range(1, 200):  # the liar adds N(0, 0.1)-like error on top of the honest lag-k residual
        q.observe_step({**{w: records(rng, HONEST[step % 3 + 1], 4, step % 3 + 1) for w in workers[:3]},
                        "liar": records(rng, HONEST[lag] + 0.035, 1, lag)})
        if q.is_quarantined("liar") and not caught:
            caught = step
    assert q.workers["liar"].reason == "sequential" and 0 < caught <= 20
    assert not any(q.is_quarantined(w) for w in workers[:3])
    assert max(q.workers[w].cusum for w in workers[:3]) < 0.3 / 4


def test_without_a_fleet_at_its_lag_a_lagged_record_gives_no_evidence():
    rng, q = np.random.default_rng(0), q_with()
    for _ in range(50):
        q.observe_step({"liar": records(rng, 0.14, 4, 1), "h1": records(rng, HONEST[0], 4, 0)})
    assert not q.is_quarantined("liar") and q.workers["liar"].cusum == 0.0 and drift(q) == pytest.approx(0.065)


def test_the_calibrated_drift_catches_a_mild_liar_the_ceiling_misses():
    def run(floor):
        rng, q = np.random.default_rng(0), q_with(drift_floor=floor)
        for step in range(1, 400):
            q.observe_step({**{w: records(rng, HONEST[0], 1, 0) for w in ("h1", "h2", "h3")},
                            "liar": records(rng, 0.0112, 1, 0)})  # 1% weight noise on the tiny model
            if q.is_quarantined("liar"):
                return step, q
        return 0, q

    step, q = run(0.005)
    assert 0 < step <= 200 and not any(q.is_quarantined(w) for w in ("h1", "h2", "h3"))
    assert run(None)[0] == 0  # the ceiling 0.065 never sees it


def test_a_lagged_level_follows_a_growing_policy_movement_so_honest_workers_stay_under_it():
    rng, q = np.random.default_rng(3), q_with()
    workers = ["h1", "h2", "h3"]
    for _ in range(3):
        q.observe_step({w: records(rng, HONEST[0], 4, 0) for w in workers})
    for step in range(80):  # the honest lag-1 level grows from 0.05 to 0.13 (an optimizer whose steps grow)
        q.observe_step({w: records(rng, 0.05 + 0.001 * step, 4, 1) for w in workers})
    assert not any(q.is_quarantined(w) for w in workers)
    assert max(q.workers[w].cusum for w in workers) < 0.3 / 4
    assert len(q.fleet.scores[1]["h1"]) == WINDOW and q.fleet.step == 83


def test_a_workers_vote_is_its_mean_score_as_the_cusum_sums_and_one_record_counts_at_most_the_clip():
    f = FleetLevels(max_lag=3)
    for w in ("a", "b"):
        for x in (0.01, 0.01, 0.01, 0.09):  # skewed, as honest scores at a high lag: mean 0.03, median 0.01
            f.add(w, 3, x)
    assert value(f, 3) == pytest.approx(0.03)
    for x in (1e9, 0.0, 0.0, 0.0):
        f.add("c", 3, x)
    assert value(f, 3, "a") == pytest.approx((0.03 + SCORE_CLIP / 4) / 2)
