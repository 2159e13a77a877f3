"""The golden table (tests/algorithms/golden.py) against both backends, to 1e-5."""

from __future__ import annotations

import numpy as np
import pytest

from stoa.algorithms import AlgoConfig, get_algorithm

from .conftest import BACKENDS
from .golden import CASES, LOGITS, TOKENS, Case
from .runners import run_loss

TOL = 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_golden_loss_and_logit_grad(case: Case, backend: str) -> None:
    algo = get_algorithm(AlgoConfig.from_dict(case.cfg), backend)
    loss, grad, metrics = run_loss(backend, algo, LOGITS, TOKENS, case.behaviour_logp, case.ref_logp,
                                   case.advantages, case.mask, algo.normalizer(case.mask), case.version_lag)
    assert loss == pytest.approx(case.loss, abs=TOL, rel=TOL)
    np.testing.assert_allclose(grad, case.grad_logits, atol=TOL, rtol=TOL)
    assert np.all(np.isfinite(grad))
    for key, want in case.metrics.items():
        assert metrics[key] == pytest.approx(want, abs=TOL, rel=TOL), key


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_golden_advantages(case: Case) -> None:
    algo = get_algorithm(AlgoConfig.from_dict(case.cfg), "torch")
    adv = algo.advantages(case.rewards, case.lengths)
    assert adv.dtype == np.float32 and adv.shape == case.rewards.shape
    np.testing.assert_allclose(adv.reshape(-1), case.advantages, atol=TOL, rtol=TOL)
