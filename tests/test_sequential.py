"""The per-worker sequential test (stoa.trainer.sequential): CUSUM values by hand, the floor at 0, bounded and
hostile records, its place in the quarantine (reason, journal round trip) and the benchmark's bound."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from stoa.bench.verify.stats import attack_row, honest_row, upper_bound
from stoa.config import ConfigError, TrainerConfig
from stoa.schemas.journal import Journal, QuarantineRow
from stoa.trainer.quarantine import Disagreement, Quarantine, sequential_params
from stoa.trainer.sequential import Cusum, CusumParams, record_score, run_length

P = CusumParams(drift=0.125, limit=0.5, cap=0.5)  # dyadic: the sums below are exact


def sums(scores, params=P) -> list[float]:
    c, out = Cusum(), []
    for s in scores:
        c = c.update(s, params)
        out.append(c.value)
    return out


def test_cusum_values_by_hand():
    # S = max(0, S + s - 0.125): 0.125, 0.0625, 0.3125, 0.1875, 0.5 (not over 0.5), 0.625 (over)
    scores = [0.25, 0.0625, 0.375, 0.0, 0.4375, 0.25]
    assert sums(scores) == [0.125, 0.0625, 0.3125, 0.1875, 0.5, 0.625]
    assert run_length(np.array(scores), P) == 6
    assert run_length(np.array(scores[:5]), P) == 0
    assert sums([0.0, 0.25]) == [0.0, 0.125]  # floored at 0, not -0.125 + 0.125
    assert Cusum(0.5).alarm(P) is False and Cusum(0.5001).alarm(P) is True


def test_an_honest_history_banks_no_credit_the_sum_floors_at_zero():
    c = Cusum()
    for _ in range(1000):
        c = c.update(0.0, P)
    assert c.value == 0.0 and c.records == 1000
    # a worker that turns liar after a long honest run is caught as fast as a fresh one
    liar = [0.3] * 10  # +0.175 a record: over 0.5 at the third
    assert run_length(np.array([0.0] * 1000 + liar), P) == 1000 + run_length(np.array(liar), P) == 1003


@pytest.mark.parametrize("hostile", [1e9, math.inf, math.nan, 7.0])
def test_one_record_moves_the_sum_by_at_most_cap_minus_drift(hostile):
    assert Cusum().update(hostile, P).value == pytest.approx(P.cap - P.drift)
    assert not Cusum().update(hostile, P).alarm(P)  # no single record quarantines
    assert P.min_records == 1 + math.floor(0.5 / 0.375) == 2
    strict = CusumParams(drift=0.1, limit=1.0, cap=0.5)
    assert strict.min_records == 3
    assert run_length(np.array([hostile] * 5), strict) == strict.min_records


@pytest.mark.parametrize("hostile", [-1e9, -math.inf])
def test_negative_scores_cannot_wipe_more_than_drift(hostile):
    assert Cusum(0.25).update(hostile, P).value == 0.125


def test_record_score_is_the_clipped_median_and_nan_never_helps():
    assert record_score(np.array([0.01, 0.2, 0.03]), 0.5) == pytest.approx(0.03)
    assert record_score(np.array([0.01, 0.9, 0.8]), 0.5) == 0.5  # clipped to cap
    assert record_score(np.array([0.01, np.nan, 0.03]), 0.5) == pytest.approx(0.03)  # NaN as the worst token
    assert record_score(np.array([0.01, np.nan, np.nan]), 0.5) == 0.5
    assert record_score(np.array([np.inf, np.inf]), 0.5) == 0.5
    assert record_score(np.array([-3.0, -1.0, 0.02]), 0.5) == 0.0
    assert record_score(np.zeros(0), 0.5) == 0.0


def test_params_are_validated():
    for bad in ({"drift": 0.5, "limit": 1.0, "cap": 0.5}, {"drift": 0.0, "limit": 1.0, "cap": 0.5},
                {"drift": 0.1, "limit": 0.39, "cap": 0.5}, {"drift": 0.1, "limit": math.inf, "cap": 0.5}):  # 0.4
        with pytest.raises(ValueError, match="drift < cap"):
            CusumParams(**bad)
    with pytest.raises(ConfigError, match="quarantine_drift"):
        TrainerConfig(quarantine_drift=0.2).validate()
    with pytest.raises(ConfigError, match="quarantine_evidence"):
        TrainerConfig(quarantine_evidence=0.05).validate()


def test_run_temperature_scales_drift_cap_and_limit():
    p = sequential_params(0.065, 1.0, 0.15, temperature=0.5)
    assert p.drift == pytest.approx(1.065 ** 2 - 1) and p.cap == pytest.approx(1.15 ** 2 - 1)
    assert p.limit == pytest.approx((1.15 ** 2 - 1) / 0.15)


# ------------------------------------------------------------------------------------ in the quarantine


def make_q(**kw) -> Quarantine:
    d = TrainerConfig()
    args = {"enabled": True, "disagreement": d.quarantine_disagreement, "reject_rate": 0.5, "min_records": 8,
            "drift": d.quarantine_drift, "evidence": 1.0} | kw
    return Quarantine(**args)


def step(q: Quarantine, worker: str, value: float, records: int = 4, tokens: int = 30) -> None:
    per = tuple(np.full(tokens, value) for _ in range(records))
    q.observe_disagreement(worker, Disagreement(np.concatenate(per), records, per))


def test_a_mild_persistent_liar_under_the_step_threshold_is_quarantined_an_honest_worker_never():
    q = make_q()
    mild = 0.095  # under the 0.15 per-step threshold, over the 0.065 drift: +0.03 a record, limit 1.0
    need = 34  # 33 x 0.03 = 0.99, 34 x 0.03 = 1.02
    for _ in range(need // 4):
        step(q, "liar", mild)
        step(q, "honest", 0.05)
    assert not q.is_quarantined("liar")
    while not q.is_quarantined("liar"):  # the pool skips a quarantined worker's records from here on
        step(q, "liar", mild, records=1)
        step(q, "honest", 0.05)
    assert q.workers["liar"].reason == "sequential" and q.workers["liar"].lag0_records == need
    for _ in range(1000):
        step(q, "honest", 0.05)
    assert not q.is_quarantined("honest") and q.workers["honest"].cusum == 0.0
    m = q.metrics()
    assert m["quarantine/cusum/honest"] == 0.0 and m["quarantine/cusum_max"] > 1.0


def test_without_the_sequential_test_the_mild_liar_passes():
    q = make_q(drift=None)
    for _ in range(100):
        step(q, "liar", 0.095)
    assert not q.is_quarantined("liar") and "quarantine/cusum_max" not in q.metrics()


def test_the_sum_survives_a_restart_through_the_journal_and_resets_when_the_test_changes():
    q = make_q()
    step(q, "liar", 0.095, records=30)
    step(q, "honest", 0.01, records=30)
    journal = Journal.parse(Journal.from_state({"quarantine": q.state()}).to_json())  # as the trainer writes it
    state = journal.state()["quarantine"]
    assert json.loads(Journal.from_state({"quarantine": q.state()}).to_json())["quarantine"]["workers"][
        "honest"] == [0, 0, 900, 0, 30, ""]  # an honest worker's sum is 0: its row stays the six an older trainer reads
    r = make_q()
    r.restore(state)
    assert r.state() == q.state() and r.workers["liar"].cusum == pytest.approx(30 * 0.03)
    step(r, "liar", 0.095, records=4)
    assert r.workers["liar"].reason == "sequential"
    other = make_q(drift=0.05)
    other.restore(state)
    assert other.workers["liar"].cusum == 0.0  # summed against another drift: not reused
    assert QuarantineRow.parse([8, 0, 0, 0, 8, ""]) == QuarantineRow(8, 0, 0, 0, 8, "", 0.0)  # an old journal
    for bad in (-1.0, float("nan"), "x", True):
        assert QuarantineRow.parse([8, 0, 0, 0, 8, "", bad]) is None
    for bad in ([0.1, 0.2], [0.1, -1, 0.2], "x", [True, 1, 1]):  # the test's identity unreadable: sums start over
        assert Journal.from_state({"quarantine": {**state, "sequential": bad}}).sequential is None


def test_upper_bound_rule_of_three_and_clopper_pearson():
    assert upper_bound(0, 100_000) == pytest.approx(3.0 / 100_000, rel=0.01)
    assert upper_bound(0, 10) == pytest.approx(1 - 0.05 ** 0.1, abs=1e-12)  # 0.2589, not 3 / 10
    assert upper_bound(1, 100) == pytest.approx(0.0466, abs=2e-4)  # exact one-sided 95% bound
    assert upper_bound(5, 5) == 1.0 and upper_bound(0, 0) == 1.0


def test_bench_rows_deal_honest_records_into_fresh_streams_and_time_attacks():
    p = CusumParams(drift=0.065, limit=1.0, cap=0.15)
    # 2,500 records in streams of 1,000: three workers; the last one's 500 records lie (0.095: +0.03 a record)
    scores = np.concatenate([np.full(2000, 0.004), np.full(500, 0.095)])
    row = honest_row("pair", scores, 4, 1000, p)
    assert (row.workers, row.sequences, row.quarantined) == (3, 10_000, 1)
    assert row.score_max == 0.095 and row.peak == pytest.approx(500 * 0.03)
    assert honest_row("pair", scores[:2000], 4, 1000, p).quarantined == 0
    a = attack_row("mild", np.full(100, 0.095), 7, p, seed=0)
    assert (a.detected, a.streams, a.median_records, a.max_records) == (7, 7, 34, 34)  # 34 x 0.03 > 1.0
    assert attack_row("weak", np.full(100, 0.07), 3, p, seed=0).detected == 0  # 100 x 0.005 < 1.0
