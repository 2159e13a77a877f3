"""The golden table (tests/algorithms/golden.py, golden_multiturn.py) against both backends, to 1e-5."""

from __future__ import annotations

import numpy as np
import pytest

from stoa.algorithms import AlgoConfig, get_algorithm
from stoa.algorithms.batch import Trajectory, build_batch
from stoa.rollouts.episode import ROLE_ACTION, ROLE_ECHO, ROLE_MASKED

from .conftest import BACKENDS
from .golden import CASES, LOGITS, Case
from .golden_multiturn import ECHO_HITS, ECHO_TOKENS, MULTI_TURN_CASES
from .runners import Extras, run_loss

TOL = 1e-5
ALL_CASES = CASES + MULTI_TURN_CASES


def _extras(case: Case) -> Extras:
    echo_n = 1.0 if case.echo_mask is None else max(1.0, float(case.echo_mask.sum()))
    return Extras(case.token_advantages, case.echo_mask, echo_n, case.echo_alpha, case.echo_hits)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ALL_CASES, ids=[c.name for c in ALL_CASES])
def test_golden_loss_and_logit_grad(case: Case, backend: str) -> None:
    algo = get_algorithm(AlgoConfig.from_dict(case.cfg), backend)
    loss, grad, metrics = run_loss(backend, algo, LOGITS, case.tokens, case.behaviour_logp, case.ref_logp,
                                   case.advantages, case.mask, algo.normalizer(case.mask), case.version_lag,
                                   _extras(case))
    assert loss == pytest.approx(case.loss, abs=TOL, rel=TOL)
    np.testing.assert_allclose(grad, case.grad_logits, atol=TOL, rtol=TOL)
    assert np.all(np.isfinite(grad))
    for key, want in case.metrics.items():
        assert metrics[key] == pytest.approx(want, abs=TOL, rel=TOL), key


@pytest.mark.parametrize("case", ALL_CASES, ids=[c.name for c in ALL_CASES])
def test_golden_advantages(case: Case) -> None:
    algo = get_algorithm(AlgoConfig.from_dict(case.cfg), "torch")
    adv = algo.advantages(case.rewards, case.lengths)
    assert adv.dtype == np.float32 and adv.shape == case.rewards.shape
    np.testing.assert_allclose(adv.reshape(-1), case.advantages, atol=TOL, rtol=TOL)


def _episode(case: Case, i: int) -> Trajectory:
    echo = np.zeros(3) if case.echo_mask is None else case.echo_mask[i]
    roles = np.where(case.mask[i] > 0, ROLE_ACTION, np.where(echo > 0, ROLE_ECHO, ROLE_MASKED))
    assert case.turns is not None and case.states is not None
    return Trajectory.multi_turn([1, 2], case.tokens[i], roles, np.full(3, -0.5), float(case.rewards[0, i]), "stop",
                                 case.turns[i], case.states[i])


@pytest.mark.parametrize("case", [c for c in ALL_CASES if c.states is not None], ids=lambda c: c.name)
def test_golden_token_advantages_from_turns_and_anchor_states(case: Case) -> None:
    algo = get_algorithm(AlgoConfig.from_dict(case.cfg), "torch")
    batch = build_batch([[_episode(case, i) for i in range(3)]], algo)
    assert batch.token_advantages is not None and case.token_advantages is not None
    np.testing.assert_allclose(batch.token_advantages, case.token_advantages, atol=TOL, rtol=TOL)
    np.testing.assert_allclose(batch.advantages, case.advantages, atol=TOL, rtol=TOL)
    np.testing.assert_array_equal(batch.mask, case.mask)
    assert case.echo_mask is not None
    np.testing.assert_array_equal(batch.echo_mask, case.echo_mask)


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_hits_are_argmax_matches(backend: str) -> None:
    algo = get_algorithm(AlgoConfig(), backend)
    if backend == "torch":
        import torch

        hits = algo.token_hits(torch.tensor(LOGITS, dtype=torch.float32), torch.tensor(ECHO_TOKENS))
        got = hits.numpy()
    else:
        import mlx.core as mx

        got = np.array(algo.token_hits(mx.array(LOGITS.astype(np.float32)), mx.array(ECHO_TOKENS)))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, ECHO_HITS)
