"""The trainer's rounding probe (stoa.trainer.rounding) floors the sequential test's calibrated drift: an honest
minority of bf16 workers in a fleet of fp32 ones is not quarantined with it, and is without it (SmolLM2-135M's
measured record scores, docs/verification.md); the probe itself is the fp32 against bf16 logprobs of one group."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stoa.algorithms import AlgoConfig, get_algorithm
from stoa.models.lora_torch import LoraSpec
from stoa.trainer.fleet import DRIFT_FACTOR, MIN_RECORDS, PROBE_EVERY, ROUNDING_FACTOR, FleetLevels, calibrated_drift
from stoa.trainer.policy import Policy
from stoa.trainer.quarantine import Disagreement, Quarantine, disagreement_values
from stoa.trainer.rounding import rounding_probe
from stoa.trainer.sequential import record_score
from stoa.trainer.step import entries_batch, train_step
from tests.test_trainer_step import make_entries

ALGO = get_algorithm(AlgoConfig.from_dict({"name": "grpo", "kl_beta": 0.0, "max_tokens": 6}), "torch")


def test_the_probe_scores_the_first_group_between_fp32_and_bf16_logprobs(tiny_dir):
    pol = Policy(tiny_dir, torch.device("cpu"))
    batch = entries_batch(make_entries(), ALGO, current_version=1)
    got = rounding_probe(pol, batch)
    assert got is not None
    e = make_entries()[0]
    comps = [s.tokens for s in e.record.samples]
    fp32 = pol.group_logprobs(e.record.prompt_tokens, comps, batch.width).detach().numpy()
    pol.autocast = True
    bf16 = pol.group_logprobs(e.record.prompt_tokens, comps, batch.width).detach().numpy()
    mask = batch.mask[: len(comps)] > 0
    assert got == pytest.approx(record_score(disagreement_values(fp32, bf16)[mask], np.inf), rel=1e-6)
    assert 0 < got < 0.1
    lora = Policy(tiny_dir, torch.device("cpu"), lora=LoraSpec(4, 8.0, ("q_proj",)))
    assert rounding_probe(lora, batch) is None  # its base is stored in the compute dtype


def test_a_step_probes_only_when_asked(tiny_dir):
    pol = Policy(tiny_dir, torch.device("cpu"))
    opt = torch.optim.SGD(pol.model.parameters(), lr=0.1)
    plain = train_step(pol, None, opt, ALGO, make_entries(), current_version=1, micro_batch=4, grad_clip=0.0)
    assert plain.rounding == [] and "rounding_probe" not in plain
    probed = train_step(pol, None, opt, ALGO, make_entries(), current_version=1, micro_batch=4, grad_clip=0.0,
                        probe=True)
    assert len(probed.rounding) == 1 and probed["rounding_probe"] == probed.rounding[0] > 0


def test_the_rounding_level_floors_the_calibrated_drift():
    f = FleetLevels(max_lag=0)
    for w in ("a", "b", "c"):
        for _ in range(MIN_RECORDS):
            f.add(w, 0, 0.0083)
    assert calibrated_drift(f, 0.005, 0.065) == pytest.approx(DRIFT_FACTOR * 0.0083)
    for _ in range(MIN_RECORDS - 1):
        f.add_rounding(0.016)
    assert calibrated_drift(f, 0.005, 0.065) == pytest.approx(DRIFT_FACTOR * 0.0083)  # too few probes yet
    assert f.wants_probe(PROBE_EVERY + 1)
    f.add_rounding(0.016)
    f.add_rounding(float("nan"))  # ignored
    assert calibrated_drift(f, 0.005, 0.065) == pytest.approx(ROUNDING_FACTOR * 0.016)
    assert calibrated_drift(f, 0.005, 0.02) == 0.02
    assert not f.wants_probe(PROBE_EVERY + 1) and f.wants_probe(2 * PROBE_EVERY)
    f.add_rounding(0.01)
    assert calibrated_drift(f, 0.005, 0.065) == pytest.approx(ROUNDING_FACTOR * np.mean([0.016] * 4 + [0.01]))


def _record(rng: np.random.Generator, mean: float, std: float, tokens: int = 24) -> np.ndarray:
    """One record whose score (the median over its tokens) is drawn around ``mean``."""
    return np.full(tokens, abs(rng.normal(mean, std)))


@pytest.mark.parametrize("probed", [True, False])
def test_an_honest_bf16_minority_among_fp32_workers_stays_unquarantined_with_the_probe(probed):
    """SmolLM2-135M, bf16 plane, fp32 trainer: fp32 workers 0.0083 +- 0.0029 a record, bf16 ones 0.0215 +- 0.0069,
    the trainer's probe ~0.016 (stoa bench verify). Without the probe the drift is 2.5 x 0.0083 = 0.021."""
    rng = np.random.default_rng(0)
    q = Quarantine(enabled=True, disagreement=0.15, reject_rate=0.5, min_records=8, drift=0.065, evidence=0.3,
                   drift_floor=0.005)
    quiet, noisy = [f"fp32-{i}" for i in range(6)], ["bf16-0", "bf16-1"]
    for step in range(800):
        stats = {w: Disagreement(v, 1, (v,), (0,)) for w, v in
                 [(w, _record(rng, 0.0083, 0.0029)) for w in quiet] + [(w, _record(rng, 0.0215, 0.0069))
                                                                        for w in noisy]}
        probes = [abs(rng.normal(0.016, 0.004))] if probed and q.wants_rounding(step) else []
        q.observe_step(stats, probes)
    caught = [w for w in noisy if q.is_quarantined(w)]
    assert not any(q.is_quarantined(w) for w in quiet)
    if probed:
        assert caught == [] and q.active is not None and q.active.drift > 0.0215
    else:
        assert caught  # what the probe is for: honest workers quarantined after a few hundred records
