"""What one forward of a loss needs, shared by the fleet trainer and local mode: micro-batch loss inputs, cold-start
packing, the clipped optimizer step."""

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


def test_a_cold_start_micro_batch_scores_the_action_tokens_only():
    from stoa.algorithms.inputs import action_tokens, pack_sft
    from stoa.episodes.demo_rows import SftRow

    rows = [SftRow(np.array([1, 2], np.int32), np.array([5, 6, 7, 8], np.int32), np.array([1, 0, 0, 1], np.int8)),
            SftRow(np.array([3], np.int32), np.array([9, 10], np.int32), np.array([1, 1], np.int8))]
    pk = pack_sft(rows)
    np.testing.assert_array_equal(pk.mask, [[1, 0, 0, 1], [1, 1, 0, 0]])
    np.testing.assert_array_equal(pk.targets[0], [5, 6, 7, 8])
    assert action_tokens(rows) == 4 == int(pk.mask.sum())


def test_clip_and_step_clips_the_global_norm_steps_and_clears():
    import torch

    from stoa.algorithms.torch_loss import clip_and_step

    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.tensor([3.0, 4.0])
    assert clip_and_step([p], opt, grad_clip=1.0) == pytest.approx(5.0)
    torch.testing.assert_close(p.detach(), torch.tensor([-0.6, -0.8]))  # the clipped gradient, norm 1
    assert p.grad is None
    p.grad = torch.tensor([3.0, 4.0])
    assert clip_and_step([p], opt, grad_clip=0.0) == pytest.approx(5.0)  # 0: no clip
    torch.testing.assert_close(p.detach(), torch.tensor([-3.6, -4.8]))
