"""The trainer hands each step's lag-0 disagreement to quarantine: a worker whose recorded logprobs are off is
quarantined after its step, an honest worker beside it is not (in-process trainer, tiny model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stoa.layout import rollout_key
from stoa.rollouts.records import RolloutRecord, Sample
from stoa.trainer.pool import Entry
from tests.test_lifecycle import make_trainer_cfg

OFF = 0.7
"""The liar's logprob error in nats a token: exp(0.7) - 1 = 1.01, far over quarantine's 0.15 yet under the
per-sample recompute limit (3.0), so its groups still train and only quarantine can catch the worker."""


@pytest.fixture
def trainer(tmp_path, stoa_cache):
    from stoa.trainer.loop import _Trainer

    t = _Trainer(make_trainer_cfg(str(tmp_path / "b"), quarantine_min_records=2), echo=lambda *_: None)
    t.open_lifecycle()
    t.last_step_at = 0.0  # set by loop(), which these tests drive by hand
    yield t
    t.close()


def lag0_entries(t, worker: str, off: float, groups: int = 2, seed: int = 0) -> list[Entry]:
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
        rec = RolloutRecord(worker, g, t.version, "f", "toy", f"train:{g}", prompt, samples)
        out.append(Entry(rollout_key("r", t.version, worker, g), rec, np.array([0.0, 1.0], np.float32)))
    return out


def test_the_trainer_quarantines_a_worker_whose_logprobs_are_off_and_not_an_honest_one(trainer):
    t = trainer
    t.resume()  # publishes v1: lag-0 records are sampled from the weights the trainer holds
    t.train(lag0_entries(t, "honest", 0.0, seed=1) + lag0_entries(t, "liar", -OFF, seed=2))
    t.settle_publish()
    assert t.quarantine.is_quarantined("liar")
    assert not t.quarantine.is_quarantined("honest")
    rows = {w: t.quarantine.workers[w].row() for w in ("honest", "liar")}
    assert rows["liar"].reason == "disagreement" and rows["liar"].lag0_records == 2 and not rows["honest"].reason
