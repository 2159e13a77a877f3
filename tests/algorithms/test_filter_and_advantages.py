"""Group filter (DAPO dynamic sampling), advantage estimators, reward shaping, input checks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from stoa.algorithms import ALGORITHM_NAMES, AlgoConfig, LossInputs, combine_metrics, get_algorithm

REWARDS = np.array([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.2, 0.7, 0.7]])
LENGTHS = np.full(REWARDS.shape, 4)


def generic_select(algo, rewards: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What the trainer does, without knowing the algorithm: filter groups, then advantages."""
    keep = algo.keep_groups(rewards)
    return keep, algo.advantages(rewards[keep], lengths[keep])


def test_dapo_drops_zero_variance_groups() -> None:
    keep, adv = generic_select(get_algorithm(AlgoConfig.preset("dapo"), "torch"), REWARDS, LENGTHS)
    assert keep.tolist() == [False, True, False, False, True]
    assert adv.shape == (2, 3) and np.all(np.abs(adv).sum(axis=1) > 0)


@pytest.mark.parametrize("name", [n for n in ALGORITHM_NAMES if n != "dapo"])
def test_other_algorithms_keep_every_group(name: str) -> None:
    keep, adv = generic_select(get_algorithm(AlgoConfig.preset(name, max_tokens=8), "torch"), REWARDS, LENGTHS)
    assert keep.dtype == bool and keep.all()
    assert adv.dtype == np.float32 and adv.shape == REWARDS.shape
    np.testing.assert_array_equal(adv[[0, 2, 3]], 0.0)  # zero-variance groups carry no signal


def test_advantage_estimators_by_hand() -> None:
    r = np.array([[3.0, 1.0, 2.0, 2.0]])
    lengths = np.ones_like(r)
    grpo = get_algorithm(AlgoConfig.preset("grpo"), "torch").advantages(r, lengths)
    np.testing.assert_allclose(grpo, [[1, -1, 0, 0]] / (np.sqrt(0.5) + 1e-6), rtol=1e-6)
    dr = get_algorithm(AlgoConfig.preset("dr_grpo", max_tokens=4), "torch").advantages(r, lengths)
    np.testing.assert_allclose(dr, [[1, -1, 0, 0]], rtol=1e-6)
    rloo = get_algorithm(AlgoConfig.preset("rloo"), "torch").advantages(r, lengths)
    np.testing.assert_allclose(rloo, [[3 - 5 / 3, 1 - 7 / 3, 2 - 2, 2 - 2]], rtol=1e-6)
    one = np.array([[1.0], [0.0]])
    for name in ("grpo", "rloo"):
        algo = get_algorithm(AlgoConfig.preset(name), "torch")
        np.testing.assert_array_equal(algo.advantages(one, np.ones_like(one)), 0.0)


def test_overlong_shaping_ramp() -> None:
    algo = get_algorithm(AlgoConfig.preset("dapo", max_tokens=10, overlong_buffer=4, overlong_penalty=0.5), "torch")
    lengths = np.array([[5, 6, 7, 8, 10, 12]])
    shaped = algo.shape_rewards(np.ones((1, 6)), lengths)
    np.testing.assert_allclose(shaped, [[1, 1, 1 - 0.125, 1 - 0.25, 0.5, 0.5]])
    same = get_algorithm(AlgoConfig.preset("dapo", max_tokens=10), "torch").shape_rewards(np.ones((1, 6)), lengths)
    np.testing.assert_array_equal(same, 1.0)


def test_bad_rewards_are_rejected() -> None:
    algo = get_algorithm(AlgoConfig.preset("grpo"), "torch")
    with pytest.raises(ValueError, match="^rewards:"):
        algo.advantages(np.array([1.0, 0.0]), np.array([1, 1]))
    with pytest.raises(ValueError, match="^rewards:"):
        algo.advantages(np.array([[1.0, np.nan]]), np.array([[1, 1]]))
    with pytest.raises(ValueError, match="^lengths:"):
        algo.advantages(np.array([[1.0, 0.0]]), np.array([[1, 1, 1]]))


def _inputs(**over) -> LossInputs:
    z = torch.zeros(2, 3)
    base: dict[str, Any] = dict(logp=z, behaviour_logp=z, ref_logp=z, advantages=torch.zeros(2), mask=torch.ones(2, 3),
                normalizer=6.0)
    base.update(over)
    return LossInputs(**base)


@pytest.mark.parametrize(("over", "field"), [
    ({"behaviour_logp": torch.zeros(2, 4)}, "behaviour_logp"),
    ({"mask": torch.ones(3, 3)}, "mask"),
    ({"advantages": torch.zeros(2, 3)}, "advantages"),
    ({"ref_logp": None}, "ref_logp"),
    ({"normalizer": 0.0}, "normalizer"),
    ({"version_lag": np.array([0, 1, 2])}, "version_lag"),
])
def test_loss_inputs_are_checked(over: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        get_algorithm(AlgoConfig.preset("grpo"), "torch").loss(_inputs(**over))


def test_normalizers() -> None:
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=np.float32)  # last row: padding only
    norm = {n: get_algorithm(AlgoConfig.preset(n, max_tokens=10), "torch").normalizer(mask) for n in ALGORITHM_NAMES}
    assert norm == {"grpo": 2.0, "dr_grpo": 20.0, "dapo": 4.0, "gspo": 2.0, "rloo": 4.0, "cispo": 4.0, "gigpo": 2.0}
    assert get_algorithm(AlgoConfig.preset("dapo"), "torch").normalizer(np.zeros((2, 3))) == 1.0


def test_combine_metrics_weights_by_denominator() -> None:
    parts = [
        {"tokens": 2.0, "tokens_pos": 2.0, "clip_frac_low": 0.5, "gate_frac_pos": 0.5, "ratio_max": 1.5,
         "pg_loss": 0.25, "tokens_lag1": 2.0, "gate_frac_lag1": 0.5},
        {"tokens": 6.0, "tokens_pos": 0.0, "clip_frac_low": 0.0, "gate_frac_pos": 0.0, "ratio_max": 2.5,
         "pg_loss": -0.5, "tokens_lag2": 6.0, "gate_frac_lag2": 1 / 6},
    ]
    assert combine_metrics(parts) == {
        "tokens": 8.0, "tokens_pos": 2.0, "clip_frac_low": 0.125, "gate_frac_pos": 0.5, "ratio_max": 2.5,
        "pg_loss": -0.25, "tokens_lag1": 2.0, "gate_frac_lag1": 0.5, "tokens_lag2": 6.0, "gate_frac_lag2": 1 / 6,
    }
