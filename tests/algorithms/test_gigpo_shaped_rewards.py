"""GiGPO's step advantages read the shaped rewards: with DAPO's overlong shaping on, two episodes of equal raw
reward but different lengths get different step advantages (computed here by hand from the shaped rewards)."""

from __future__ import annotations

import numpy as np

from stoa.algorithms import AlgoConfig, get_algorithm
from stoa.algorithms.advantages import STD_EPS
from stoa.algorithms.batch import Trajectory, build_batch

# max_tokens 6, buffer 4: the ramp starts after 2 action tokens; penalty 1 reaches -1 at 6.
SHAPING = {"max_tokens": 6, "overlong_buffer": 4, "overlong_penalty": 1.0}
GIGPO = get_algorithm(AlgoConfig.preset("gigpo", gigpo_gamma=0.5, gigpo_omega=2.0, **SHAPING), "torch")
GRPO = get_algorithm(AlgoConfig.preset("grpo", **SHAPING), "torch")


def _episode(roles: list[int]) -> Trajectory:
    """A two-turn episode with raw reward 1 through anchor states a then b (role 1 action, 2 observation)."""
    return Trajectory.multi_turn([5, 6], list(range(10, 10 + len(roles))), roles, [-0.5] * len(roles), 1.0,
                                 "stop", None, ("a", "b"))


def test_gigpo_step_advantages_use_the_overlong_shaped_rewards():
    short = _episode([1, 2, 1])  # 2 action tokens: no penalty, shaped reward 1
    long = _episode([1, 1, 1, 2, 1, 1])  # 5 action tokens: penalty (5 - 2) / 4, shaped reward 0.25
    batch = build_batch([[short, long]], GIGPO)
    ep = batch.advantages
    np.testing.assert_array_equal(ep, build_batch([[short, long]], GRPO).advantages)  # the episode term is GRPO's
    assert ep[0] > 0 > ep[1]  # shaped: the raw rewards are equal, so raw would give 0 and 0
    # gamma 0.5, two turns: returns (0.5, 1.0) and (0.125, 0.25); anchors a and b each pair the two episodes
    step_a = 0.1875 / (0.1875 + STD_EPS)
    step_b = 0.375 / (0.375 + STD_EPS)
    assert batch.token_advantages is not None
    want_short = [ep[0] + 2 * step_a, ep[0], ep[0] + 2 * step_b]  # A O A
    want_long = [ep[1] - 2 * step_a] * 3 + [ep[1]] + [ep[1] - 2 * step_b] * 2  # A A A O A A
    np.testing.assert_allclose(batch.token_advantages[0, :3], want_short, rtol=1e-6)
    np.testing.assert_allclose(batch.token_advantages[1], want_long, rtol=1e-6)

def test_without_shaping_equal_raw_rewards_give_no_step_advantage():
    plain = get_algorithm(AlgoConfig.preset("gigpo", gigpo_gamma=0.5, gigpo_omega=2.0), "torch")
    batch = build_batch([[_episode([1, 2, 1]), _episode([1, 1, 1, 2, 1, 1])]], plain)
    assert batch.token_advantages is not None
    assert not np.any(batch.token_advantages)  # the control: the signal above comes from the shaping alone
