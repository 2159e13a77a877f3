"""``micro_inputs``: one micro-batch's loss inputs, the same builder for the fleet trainer's step and local mode."""

from __future__ import annotations

import numpy as np
import pytest

from stoa.algorithms import AlgoConfig, get_algorithm
from stoa.algorithms.batch import Trajectory, build_batch
from stoa.algorithms.inputs import micro_inputs

ALGO = get_algorithm(AlgoConfig.preset("grpo"), "torch")


def _batch():
    def traj(prompt: list[int], tokens: list[int], reward: float) -> Trajectory:
        return Trajectory.single_turn(prompt, tokens, [-0.5 - i for i in range(len(tokens))], reward, "stop")

    return build_batch([[traj([1, 2], [4, 5], 1.0), traj([1, 2], [6], 0.0)],
                        [traj([7], [9, 10, 11], 0.5), traj([7], [12], 0.0)]], ALGO, version_lag=[0, 3])


def test_rows_of_the_batch_with_its_old_policy_reference_and_lags():
    b = _batch()
    b.old_logp = b.rollout_logp * 2
    b.ref_logp = b.rollout_logp * 3
    idx = np.array([3, 1])
    logp = np.ones((2, b.width), np.float32)
    inp = micro_inputs(b, idx, logp, to=np.asarray)
    np.testing.assert_array_equal(inp.behaviour_logp, b.old_logp[idx])
    np.testing.assert_array_equal(inp.ref_logp, b.ref_logp[idx])
    np.testing.assert_array_equal(inp.advantages, b.advantages[idx])
    np.testing.assert_array_equal(inp.mask, b.mask[idx])
    np.testing.assert_array_equal(inp.version_lag, [3, 0])
    assert inp.normalizer == b.normalizer and inp.echo_mask is None and inp.logp is logp
    mine = np.full((2, b.width), -9.0, np.float32)  # a reference computed for this micro-batch wins
    assert micro_inputs(b, idx, logp, to=np.asarray, ref_logp=mine, lags=False).ref_logp is mine
    assert micro_inputs(b, idx, logp, to=np.asarray, lags=False).version_lag is None


def test_without_old_logprobs_the_forward_is_its_own_old_policy_and_kept_rows_mask_the_rest():
    b = _batch()
    idx = np.array([0, 2])
    logp = np.full((2, b.width), -0.25, np.float32)
    with pytest.raises(ValueError, match="pass stop="):
        micro_inputs(b, idx, logp, to=np.asarray)
    inp = micro_inputs(b, idx, logp, to=np.asarray, stop=lambda a: a * 0 - 7, keep=np.array([1.0, 0.0]),
                       echo=True, echo_alpha=0.5)
    np.testing.assert_array_equal(inp.behaviour_logp, np.full((2, b.width), -7.0))
    np.testing.assert_array_equal(inp.mask, np.stack([b.mask[0], np.zeros(b.width)]))
    np.testing.assert_array_equal(inp.echo_mask, np.zeros((2, b.width)))  # single-turn rows: no echo token
    assert inp.echo_alpha == 0.5 and inp.ref_logp is None
