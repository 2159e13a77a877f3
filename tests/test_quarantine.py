"""Worker quarantine: the lag-0 disagreement statistic, both triggers, the off switch, the journal round trip,
and train_step's per-worker lag-0 values."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from stoa.algorithms import AlgoConfig, get_algorithm
from stoa.engines.torch_scoring import pack_tensors
from stoa.layout import rollout_key
from stoa.rollouts.records import RolloutRecord, Sample
from stoa.trainer.policy import Policy
from stoa.trainer.pool import Entry
from stoa.trainer.quarantine import Disagreement, Quarantine, disagreement_values
from stoa.trainer.step import train_step


def make_q(**kw) -> Quarantine:
    args = {"enabled": True, "disagreement": 0.05, "reject_rate": 0.5, "min_records": 8} | kw
    return Quarantine(**args)


def feed(q: Quarantine, worker: str, value: float, *, steps: int = 4, tokens: int = 20,
         records: int = 2) -> None:
    for _ in range(steps):
        q.observe_disagreement(worker, Disagreement(np.full(tokens, value), records))


def test_statistic_by_hand():
    vals = disagreement_values(np.array([-1.0, -2.0, -0.5]), np.array([-1.0, -1.5, -0.6]))
    np.testing.assert_allclose(vals, [0.0, math.exp(0.5) - 1, math.exp(0.1) - 1], rtol=1e-12)
    assert Disagreement(vals, 1).median == pytest.approx(math.exp(0.1) - 1, rel=1e-12)
    assert Disagreement(np.zeros(0), 0).median == 0.0


def test_worker_over_the_disagreement_threshold_is_quarantined_one_under_is_not():
    q = make_q()
    feed(q, "liar", 0.06)  # 8 lag-0 records, every token just over 0.05
    feed(q, "honest", 0.04)
    assert q.is_quarantined("liar") and not q.is_quarantined("honest")
    m = q.metrics()
    assert m["quarantine/workers"] == 1 and m["quarantine/new"] == 1 and m["quarantine/tracked"] == 2
    assert m["quarantine/disagreement/liar"] == pytest.approx(0.06)
    assert m["quarantine/disagreement/honest"] == pytest.approx(0.04)
    assert q.metrics()["quarantine/new"] == 0  # counts are per period


def test_disagreement_is_the_median_and_waits_for_min_records():
    q = make_q()
    q.observe_disagreement("w", Disagreement(np.array([0.01, 0.2, 0.3]), 7))
    assert not q.is_quarantined("w")  # 7 lag-0 records < min_records
    assert q.metrics()["quarantine/disagreement/w"] == pytest.approx(0.2)  # the step's median, not its mean
    q.observe_disagreement("w", Disagreement(np.array([0.01, 0.2, 0.3]), 1))
    assert q.is_quarantined("w")  # 4 of 6 tokens over: median over
    q2 = make_q()
    q2.observe_disagreement("w", Disagreement(np.array([0.01, 0.02, 0.3, 0.4]), 8))
    assert not q2.is_quarantined("w")  # half over is not more than half: median not over
    q3 = make_q()
    q3.observe_disagreement("w", Disagreement(np.array([0.01, np.nan, np.nan]), 8))
    assert q3.is_quarantined("w")  # a non-finite recompute counts as over


def test_window_catches_a_worker_that_turns_dishonest_late():
    q = make_q()
    feed(q, "w", 0.001, steps=20, tokens=q.TOKEN_WINDOW)  # a long honest history
    assert not q.is_quarantined("w")
    feed(q, "w", 1.0, steps=8, tokens=q.TOKEN_WINDOW // 8)  # caught within one window of tokens
    assert q.is_quarantined("w")


def test_top_p_and_temperature_scale_the_threshold():
    q = make_q(top_p=0.9)
    assert q.threshold == pytest.approx(1.05 / 0.9 - 1)
    feed(q, "w", 0.15)  # over 0.05 but under (1.05 / 0.9 - 1) = 0.1667: nucleus renormalisation
    assert not q.is_quarantined("w")
    cold = make_q(temperature=0.5)  # rounding errors of the logits are doubled at T = 0.5
    assert cold.threshold == pytest.approx(1.05**2 - 1)
    feed(cold, "w", 0.1)
    assert not cold.is_quarantined("w")
    assert make_q(temperature=2.0, top_p=0.9).threshold == pytest.approx(1.05**0.5 / 0.9 - 1)


def test_rejection_rate_after_min_records():
    q = make_q()
    for _ in range(7):
        q.observe("bad", accepted=False)
    assert not q.is_quarantined("bad")  # under min_records
    q.observe("bad", accepted=False)
    assert q.is_quarantined("bad")
    for i in range(16):  # exactly half rejected: not over the rate
        q.observe("flaky", accepted=not i % 2)
    assert not q.is_quarantined("flaky")
    q.observe("flaky", accepted=False)
    assert q.is_quarantined("flaky")
    for _ in range(q.RECORD_WINDOW * 4):
        q.observe("good", accepted=True)
    for _ in range(q.RECORD_WINDOW // 2 + 2):  # a late run of rejections still counts within the window
        q.observe("good", accepted=False)
    assert q.is_quarantined("good")


def test_disabled_never_quarantines_but_still_reports():
    q = make_q(enabled=False)
    feed(q, "liar", 10.0)
    for _ in range(50):
        q.observe("bad", accepted=False)
    assert not q.is_quarantined("liar") and not q.is_quarantined("bad")
    m = q.metrics()
    assert m["quarantine/workers"] == 0 and m["quarantine/new"] == 0
    assert m["quarantine/disagreement/liar"] == pytest.approx(10.0)


def test_state_restore_round_trip_through_json():
    q = make_q()
    feed(q, "liar", 0.5)
    for _ in range(7):
        q.observe("almost", accepted=False)
    q.observe_disagreement("close", Disagreement(np.full(10, 0.5), 7))
    state = json.loads(json.dumps(q.state()))
    r = make_q()
    r.restore(state)
    assert r.state() == q.state()
    assert r.is_quarantined("liar") and not r.is_quarantined("almost")
    r.observe("almost", accepted=False)  # the restored count carries on: 8th rejection of 8
    assert r.is_quarantined("almost")
    r.observe_disagreement("close", Disagreement(np.full(10, 0.5), 1))
    assert r.is_quarantined("close")
    other = make_q(disagreement=0.2)  # counts against another threshold are not reused
    other.restore(state)
    assert other.is_quarantined("liar") and other.workers["close"].tokens == 0


def test_restore_drops_malformed_entries_without_raising():
    q = make_q()
    rows = {"ok": [8, 8, 0, 0, 0, "reject_rate"], "neg": [-1, 0, 0, 0, 0, ""], "short": [1, 2],
            "reason": [1, 0, 0, 0, 0, "x"], "huge": [1e400, 0, 0, 0, 0, ""],
            "nan": [float("nan"), 0, 0, 0, 0, ""]}
    q.restore({"threshold": 0.05, "workers": rows})
    assert list(q.workers) == ["ok"] and q.is_quarantined("ok")
    for junk in ({}, {"workers": []}, {"workers": {"a": "b"}}, {"threshold": "x"}):
        q.restore(junk)
        assert not q.workers


def test_tracked_workers_are_bounded_and_quarantined_ones_kept():
    q = make_q(max_workers=3)
    feed(q, "liar", 1.0)
    for i in range(10):
        q.observe(f"w{i}", accepted=True)
    assert len(q.workers) == 3 and q.is_quarantined("liar")


# ------------------------------------------------------------------------------------ train_step


def _entries(policy: Policy, current: int) -> tuple[list[Entry], dict[str, float]]:
    """Groups of three workers: 'hon-est' at lag 0 (records the policy's own logprobs), 'li-ar' at lag 0
    (logprobs shifted by 0.5; one more group at lag 1), 'old' at lag 1 (shifted by 2.0).
    Lag 1 is left out of the threshold's values, kept with its lag for the sequential test."""
    rng = np.random.default_rng(0)
    out, shift = [], {"hon-est": 0.0, "li-ar": 0.5, "old": 2.0}
    for g, (worker, version) in enumerate([("hon-est", current), ("li-ar", current), ("old", current - 1),
                                           ("hon-est", current), ("li-ar", current - 1)]):
        prompt = rng.integers(3, 500, size=6).astype(np.int32)
        comps = [rng.integers(3, 500, size=int(t)).astype(np.int32) for t in (3, 5)]
        with torch.no_grad():
            lp = policy.logprobs(pack_tensors([prompt] * 2, comps, 5, torch.device("cpu"))).numpy()
        samples = [Sample(c, (lp[i, : len(c)] - shift[worker]).astype(np.float32), float(i), "length")
                   for i, c in enumerate(comps)]
        rec = RolloutRecord("header-id", g, version, "f", "toy", f"train:{g}", prompt, samples)
        out.append(Entry(rollout_key("r", version, worker, g), rec, np.array([0.0, 1.0], np.float32)))
    return out, shift


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_train_step_returns_lag0_disagreement_per_worker(tiny_dir, shared_prefix):
    torch.manual_seed(0)
    pol = Policy(tiny_dir, torch.device("cpu"))
    entries, _ = _entries(pol, current=3)
    opt = torch.optim.SGD(pol.model.parameters(), lr=0.1)
    algo = get_algorithm(AlgoConfig.from_dict({"name": "grpo", "kl_beta": 0.0, "max_tokens": 5}), "torch")
    m = train_step(pol, None, opt, algo, entries, current_version=3, micro_batch=3, grad_clip=0.0,
                   shared_prefix=shared_prefix)
    assert np.isfinite(m["loss"]) and all(isinstance(v, float) for v in m.values())
    d = m.disagreement
    assert set(d) == {"hon-est", "li-ar", "old"}  # the key's worker
    assert d["hon-est"].records == 2 and d["hon-est"].values.size == 16
    assert d["li-ar"].records == 1 and d["li-ar"].values.size == 8  # its lag-1 group is left out of the threshold's
    assert d["old"].records == 0 and d["old"].values.size == 0
    assert [r.size for r in d["hon-est"].per_record] == [8, 8]  # split by record for the sequential test
    assert [r.size for r in d["li-ar"].per_record] == [8, 8] and d["li-ar"].lags == (0, 1)  # lagged ones too
    assert d["old"].lags == (1,) and d["hon-est"].record_lags() == (0, 0)
    np.testing.assert_allclose(d["old"].per_record[0], math.exp(2.0) - 1, rtol=1e-4)  # against the current policy
    assert float(d["hon-est"].values.max()) < 1e-4
    np.testing.assert_allclose(d["li-ar"].values, math.exp(0.5) - 1, rtol=1e-4)


def test_bench_flags_no_honest_torch_worker_and_catches_random_logprobs(tiny_dir, tmp_path):
    import argparse

    from stoa.bench.checkout import load_script

    calibration = load_script("quarantine_calibration.py")
    add_arguments, main = calibration.add_arguments, calibration.main

    p = argparse.ArgumentParser()
    add_arguments(p)
    out = tmp_path / "q.jsonl"
    flags = ["--model", str(tiny_dir), "--engines", "torch", "--batches", "2", "--groups", "2",
             "--samples", "2", "--tokens", "12", "--liars", "random", "--min-records", "2", "--out", str(out)]
    assert main(p.parse_args(flags)) == 0
    summary = json.loads(out.read_text().splitlines()[-1])["summary"]
    # 2 dtypes x 2 trainer recomputes
    assert summary["honest_settings"] == 4 and summary["false_positives"] == 0
    assert summary["liar_settings"] == 2 and summary["liars_caught"] == 2
    assert summary["margin"] > 3
    # Per sample (the step's recompute check): no honest sample over the limit, every random-logprob one over it.
    assert summary["honest_samples"] == 4 * 2 * 2 * 2 and summary["honest_samples_over_limit"] == 0
    assert summary["honest_sample_median_max"] < summary["recompute_limit"] / 10
    assert summary["liar_samples_over_limit"] == summary["liar_samples"] == 2 * 2 * 2 * 2
