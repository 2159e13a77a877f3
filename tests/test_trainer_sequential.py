"""The trainer's sequential test end to end: a worker whose lag-0 logprobs are off by a little on every token
(each step's median under quarantine's threshold) is quarantined once its records add up, an honest worker beside
it is not (in-process trainer, tiny model, the default settings)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stoa.config import TrainerConfig
from stoa.layout import rollout_key
from stoa.rollouts.records import RolloutRecord, Sample
from stoa.trainer.pool import Entry
from tests.test_lifecycle import make_trainer_cfg

OFF = 0.12
"""The mild liar's logprob error in nats a token: exp(0.12) - 1 = 0.1275, under quarantine's 0.15 (no step
quarantines it) and over the default drift 0.065 (two workers: too few to calibrate it) by 0.0625: 5 records pass
the default limit 0.3."""


@pytest.fixture
def trainer(tmp_path, stoa_cache):
    from stoa.trainer.loop import _Trainer

    t = _Trainer(make_trainer_cfg(str(tmp_path / "b"), quarantine_min_records=2), echo=lambda *_: None)
    t.open_lifecycle()
    t.last_step_at = 0.0  # set by loop(), which these tests drive by hand
    yield t
    t.close()


def lag0_entries(t, worker: str, off: float, groups: int, seed: int) -> list[Entry]:
    """``groups`` records of ``worker`` at the trainer's version, with the trainer's own logprobs plus ``off``."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(3, 500, size=6).astype(np.int32)
        toks = [rng.integers(3, 500, size=n).astype(np.int32) for n in (5, 4)]
        with torch.no_grad():
            lp = t.policy.group_logprobs(prompt, toks, 5).float().numpy()
        samples = [Sample(x, (lp[i, : x.size] + off).astype(np.float32), float(i), "length")
                   for i, x in enumerate(toks)]
        seq = seed * 100 + g
        rec = RolloutRecord(worker, seq, t.version, "f", "toy", f"train:{seq}", prompt, samples)
        out.append(Entry(rollout_key("r", t.version, worker, seq), rec, np.array([0.0, 1.0], np.float32)))
    return out


def test_the_drift_factor_setting_reaches_the_quarantine(tmp_path, stoa_cache):
    from stoa.trainer.loop import _Trainer

    t = _Trainer(make_trainer_cfg(str(tmp_path / "b"), quarantine_drift_factor=1.5), echo=lambda *_: None)
    try:
        assert t.quarantine.drift_factor == 1.5 and TrainerConfig().quarantine_drift_factor == 2.5
    finally:
        t.close()


def test_a_mildly_lying_worker_is_quarantined_after_enough_records_an_honest_one_never(trainer):
    t = trainer
    d = TrainerConfig()
    assert t.cfg.quarantine_sequential and t.quarantine.sequential is not None  # on by default
    per_record = math.expm1(OFF) - d.quarantine_drift
    assert math.expm1(OFF) < d.quarantine_disagreement and 4 * per_record < d.quarantine_evidence < 5 * per_record
    t.resume()  # publishes v1: lag-0 records are sampled from the weights the trainer holds
    for step in range(3):  # 2 records of each worker a step: 2, 4 (sum 0.25), 6 (over 0.3 at the 5th)
        assert not t.quarantine.is_quarantined("liar"), step
        t.train(lag0_entries(t, "honest", 0.0, 2, seed=2 * step + 1) + lag0_entries(t, "liar", -OFF, 2,
                                                                                   seed=2 * step + 2))
        t.settle_publish()
    rows = {w: t.quarantine.workers[w] for w in ("honest", "liar")}
    assert rows["liar"].reason == "sequential" and rows["liar"].lag0_records == 6
    assert not rows["honest"].reason and rows["honest"].cusum == 0.0
    assert t.quarantine.state()["workers"]["liar"][6] > 0.3  # the sum goes into the journal
    probes = list(t.quarantine.fleet.rounding)  # each step's rounding probe reached the drift's calibration
    assert len(probes) == 3 and all(0 < x < 0.05 for x in probes)


@pytest.mark.slow  # about 17 s on a loaded 2-core box (four trainer steps)
def test_a_worker_lying_at_lag_1_is_quarantined_by_its_excess_over_the_fleet_honest_lagged_ones_never(trainer):
    t = trainer
    t.resume()
    workers = ("h1", "h2", "liar")

    def honest_step(n: int, seed: int) -> None:  # n lag-0 records of every worker, honest
        t.train([e for i, w in enumerate(workers) for e in lag0_entries(t, w, 0.0, n, seed=seed + i)])
        t.settle_publish()

    honest_step(1, 0)  # a fresh trainer's first lag 0 is not trusted
    lagged = [e for i, w in enumerate(workers)  # sampled now, trained one version later: lag 1
              for e in lag0_entries(t, w, -OFF if w == "liar" else 0.0, 4, seed=100 + i)]
    honest_step(4, 10)  # calibrates the drift: three workers' records
    assert t.quarantine.active is not None and t.quarantine.active.drift == pytest.approx(0.005)  # the floor
    assert {t.version - e.record.policy_version for e in lagged} == {1}
    t.train(lagged)
    rows = t.quarantine.workers
    assert rows["liar"].reason == "sequential"  # exp(0.12) - 1 over the others' lag-1 level: 3 records pass 0.3
    assert not any(rows[w].reason for w in workers[:2]) and max(rows[w].cusum for w in workers[:2]) < 0.05


def test_a_majority_lying_alike_at_lag_0_is_quarantined_the_honest_minority_never(trainer):
    """Two of three workers off by the same ``OFF`` on every token: the fleet's lag-0 level is theirs, so the drift
    it calibrates would hide them, but it is capped at ``quarantine_drift`` (the ceiling), over which their error
    sits; lag 0 compares with the trainer's own recompute, not with a vote, so the honest minority scores 0."""
    t = trainer
    t.resume()
    liars = ("l1", "l2")
    for step in range(3):  # 2 records of each worker a step, as above: over the limit at the 5th
        assert not any(t.quarantine.is_quarantined(w) for w in liars), step
        entries = lag0_entries(t, "honest", 0.0, 2, seed=10 * step)
        for i, w in enumerate(liars):
            entries += lag0_entries(t, w, -OFF, 2, seed=10 * step + 1 + i)
        t.train(entries)
        t.settle_publish()
    rows = t.quarantine.workers
    assert all(rows[w].reason == "sequential" for w in liars)
    assert not rows["honest"].reason and rows["honest"].cusum == 0.0
    active = t.quarantine.active  # calibrated from three workers' lag-0 records: 2.5 x 0.1275, capped
    assert active is not None and active.drift == pytest.approx(TrainerConfig().quarantine_drift)
