"""Multi-turn trajectories, GiGPO's step advantages by hand, and what the batch and pack carry."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stoa.algorithms import AlgoConfig, get_algorithm
from stoa.algorithms.advantages import (
    STD_EPS,
    anchor_step_advantages,
    discounted_turn_returns,
    gigpo_turn_advantages,
)
from stoa.algorithms.batch import Trajectory, build_batch, pack

GRPO = get_algorithm(AlgoConfig.preset("grpo"), "torch")
GIGPO = get_algorithm(AlgoConfig.preset("gigpo", gigpo_gamma=0.5, gigpo_omega=2.0), "torch")

# A E E A M A: turn 0 = token 0, turn 1 = token 3, turn 2 = token 5
ROLES = [1, 2, 2, 1, 0, 1]


def _episode(reward: float, states: tuple[str, ...] = ("a", "b", "c"), roles: list[int] = ROLES) -> Trajectory:
    lp = [-0.1 * (i + 1) for i in range(len(roles))]
    return Trajectory.multi_turn([5, 6], list(range(10, 10 + len(roles))), roles, lp, reward, "stop", None, states)


def test_multi_turn_trajectory_masks_turns_and_logprobs():
    t = _episode(1.0)
    np.testing.assert_array_equal(t.action_mask, [1, 0, 0, 1, 0, 1])
    np.testing.assert_array_equal(t.echo_mask, [0, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(t.turn_of_token, [0, -1, -1, 1, -1, 2])
    np.testing.assert_allclose(t.rollout_logprobs, [-0.1, 0, 0, -0.4, 0, -0.6])  # observation logprobs dropped
    assert t.turn_of_token is not None and t.turn_of_token.dtype == np.int32
    assert t.states == ("a", "b", "c") and t.echo_mask.dtype == np.float32
    given = Trajectory.multi_turn([5], [1, 2, 3], [1, 1, 1], [-1.0] * 3, 0.0, "length", [0, 0, 1], ("s", "t"))
    np.testing.assert_array_equal(given.turn_of_token, [0, 0, 1])  # a turn split without an observation
    single = Trajectory.single_turn([5], [1, 2], [-1.0, -2.0], 1.0, "stop")
    np.testing.assert_array_equal(single.echo_mask, [0, 0])
    assert single.turn_of_token is None and single.states == ()


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"roles": [1, 3, 1]}, "roles"),
    ({"roles": [0, 2, 0]}, "roles"),
    ({"roles": [1, 1]}, "roles, logprobs"),
    ({"states": ("a",)}, "states"),
    ({"turn_of_token": [0, 0, 1]}, "turn_of_token"),
    ({"turn_of_token": [1, -1, 1]}, "turn_of_token"),
    ({"turn_of_token": [1, -1, 0], "states": ("a", "b")}, "turn_of_token"),
])
def test_multi_turn_trajectory_refuses_inconsistent_roles(kwargs, field):
    args = {"roles": [1, 2, 1], "turn_of_token": None, "states": ("a", "b"), **kwargs}
    with pytest.raises(ValueError) as e:
        Trajectory.multi_turn([5], [1, 2, 3], args["roles"], [-1.0] * 3, 0.0, "stop", args["turn_of_token"],
                              args["states"])
    assert str(e.value).split(":")[0] == field, str(e.value)


def test_step_advantages_by_hand():
    np.testing.assert_allclose(discounted_turn_returns(2.0, 3, 0.5), [0.5, 1.0, 2.0])
    assert discounted_turn_returns(1.0, 0, 0.9).shape == (0,)
    # anchors: "a" = {row0 t0, row1 t0, row2 t0}, "b" = {row0 t1, row0 t2 (a recurring state)}, "c" alone,
    # "" never grouped
    returns = [np.array([1.0, 2.0, 4.0]), np.array([3.0, 5.0]), np.array([2.0])]
    states = [("a", "b", "b"), ("a", "c"), ("a",)]
    out = anchor_step_advantages(returns, states, std_norm=True)
    std_a = math.sqrt(((1 - 2) ** 2 + (3 - 2) ** 2 + 0) / 3)
    np.testing.assert_allclose(out[0], [-1 / (std_a + STD_EPS), -1 / (1 + STD_EPS), 1 / (1 + STD_EPS)])
    np.testing.assert_allclose(out[1], [1 / (std_a + STD_EPS), 0.0])
    np.testing.assert_allclose(out[2], [0.0])
    plain = anchor_step_advantages(returns, states, std_norm=False)
    np.testing.assert_allclose(plain[0], [-1.0, -1.0, 1.0])
    empty = anchor_step_advantages([np.array([1.0]), np.array([0.0])], [("",), ("",)], std_norm=True)
    assert [e.tolist() for e in empty] == [[0.0], [0.0]]
    with pytest.raises(ValueError, match="^states: trajectory 0 has 2 turn returns but 1"):
        anchor_step_advantages([np.zeros(2)], [("a",)], std_norm=True)


def test_gigpo_turn_advantages_scale_by_omega_per_group():
    rewards = np.array([[1.0, 0.0], [1.0, 1.0]])
    states = [[("s", "u"), ("s", "u")], [("s",), ("s",)]]
    out = gigpo_turn_advantages(rewards, states, gamma=0.5, omega=3.0, std_norm=False)
    # group 0: anchor s = {0.5, 0}, u = {1, 0}; group 1 is its own (equal returns: 0); keys never cross groups
    np.testing.assert_allclose(out[0][0], [3 * 0.25, 3 * 0.5])
    np.testing.assert_allclose(out[0][1], [-3 * 0.25, -3 * 0.5])
    assert out[1][0].tolist() == [0.0] and out[1][1].tolist() == [0.0]
    with pytest.raises(ValueError, match="^states:"):
        gigpo_turn_advantages(rewards, states[:1], 0.5, 1.0, True)


def test_gigpo_batch_spreads_turn_advantages_over_action_tokens():
    rows = [_episode(1.0, ("a", "b", "c")), _episode(0.0, ("a", "b", "d"))]
    batch = build_batch([rows], GIGPO)
    grpo = build_batch([rows], GRPO)
    np.testing.assert_array_equal(batch.advantages, grpo.advantages)
    assert batch.normalizer == grpo.normalizer and grpo.token_advantages is None
    ep = batch.advantages
    # gamma 0.5, K 3: returns (0.25, 0.5, 1) and (0, 0, 0); anchors a and b pair up, c and d are singletons
    step_a = 0.125 / (0.125 + STD_EPS)
    step_b = 0.25 / (0.25 + STD_EPS)
    want0 = [ep[0] + 2 * step_a, ep[0], ep[0], ep[0] + 2 * step_b, ep[0], ep[0]]
    want1 = [ep[1] - 2 * step_a, ep[1], ep[1], ep[1] - 2 * step_b, ep[1], ep[1]]
    assert batch.token_advantages is not None
    np.testing.assert_allclose(batch.token_advantages, [want0, want1], rtol=1e-6)
    np.testing.assert_array_equal(batch.echo_mask, [[0, 1, 1, 0, 0, 0]] * 2)
    assert batch.echo_normalizer == 4.0
    pk = pack(batch, np.array([1]))
    assert pk.echo_mask is not None and pk.token_advantages is not None
    np.testing.assert_array_equal(pk.echo_mask, batch.echo_mask[[1]])
    np.testing.assert_array_equal(pk.token_advantages, batch.token_advantages[[1]])


def test_gigpo_reduces_to_grpo_without_turns_or_omega():
    single = [[Trajectory.single_turn([1, 2], [3, 4, 5][: k + 1], [-0.5] * (k + 1), float(k % 2), "stop")
               for k in range(3)]]
    g, r = build_batch(single, GIGPO), build_batch(single, GRPO)
    assert g.token_advantages is None and g.normalizer == r.normalizer
    np.testing.assert_array_equal(g.advantages, r.advantages)
    np.testing.assert_array_equal(g.echo_mask, np.zeros_like(g.mask))
    assert g.echo_normalizer == 1.0
    pk = pack(g, np.array([0, 2]))
    assert pk.token_advantages is None
    np.testing.assert_array_equal(pk.echo_mask, np.zeros((2, 3)))
    no_omega = get_algorithm(AlgoConfig.preset("gigpo", gigpo_omega=0.0), "torch")
    rows = [_episode(1.0), _episode(0.0), _episode(0.5, ("a", "x", "c"))]
    batch = build_batch([rows], no_omega)
    assert batch.token_advantages is not None
    np.testing.assert_array_equal(batch.token_advantages, np.repeat(batch.advantages[:, None], 6, axis=1))
