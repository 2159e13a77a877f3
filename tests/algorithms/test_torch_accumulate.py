"""The micro-batch loop the fleet trainer's step and local mode's torch backend share (``torch_accumulate``): split
equals whole, the observer's dropped rows train nothing, an undo cancels, a batch without old logprobs is
on-policy, and the echo settings of a step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stoa.algorithms import AlgoConfig, get_algorithm
from stoa.algorithms.batch import Batch, Trajectory, build_batch
from stoa.algorithms.inputs import echo_step
from stoa.algorithms.torch_accumulate import MicroForward, accumulate
from stoa.rollouts.episode import ROLE_ACTION, ROLE_ECHO, ROLE_MASKED

ALGO = get_algorithm(AlgoConfig.preset("grpo", kl_beta=0.0), "torch")


def _batch() -> Batch:
    def traj(tokens: list[int], reward: float) -> Trajectory:
        return Trajectory.single_turn([1, 2], tokens, [-0.5 - 0.1 * i for i in range(len(tokens))], reward, "stop")

    b = build_batch([[traj([4, 5, 6], 1.0), traj([6], 0.0), traj([7, 8], 0.5)],
                     [traj([9, 10], 0.25), traj([11, 12, 13], 1.0), traj([3], 0.0)]], ALGO)
    b.old_logp = b.rollout_logp.copy()
    return b


class Toy:
    """A 'policy' whose logprob of token t at position j is theta[t] + 0.01 j: gradients land on theta per token."""

    def __init__(self, batch: Batch):
        self.batch = batch
        self.theta = torch.nn.Parameter(torch.linspace(-1.0, -0.2, 16))

    def forward(self, idx: np.ndarray) -> MicroForward:
        tokens = torch.as_tensor(np.stack([np.pad(self.batch.rows[int(i)].tokens,
                                                  (0, self.batch.width - len(self.batch.rows[int(i)].tokens)))
                                           for i in idx]), dtype=torch.long)
        logp = self.theta[tokens] + 0.01 * torch.arange(self.batch.width)[None, :]
        return MicroForward(logp * torch.as_tensor(self.batch.mask[idx]), None, None)

    def grad(self) -> np.ndarray:
        g = self.theta.grad
        out = np.zeros(16, np.float32) if g is None else g.detach().numpy().copy()
        self.theta.grad = None
        return out


def _run(toy: Toy, micro: list[list[int]], **kw):
    batch = toy.batch
    return accumulate(ALGO, batch, [np.array(m) for m in micro], toy.forward, to=torch.as_tensor,
                      echo=echo_step(batch, ALGO, None), **kw)


def test_micro_batches_sum_to_the_whole_batch() -> None:
    toy = Toy(_batch())
    whole = _run(toy, [[0, 1, 2, 3, 4, 5]])
    g_whole = toy.grad()
    split = _run(toy, [[0, 1], [2, 3, 4], [5]])
    g_split = toy.grad()
    assert np.abs(g_whole).max() > 0
    np.testing.assert_allclose(g_split, g_whole, rtol=1e-5, atol=1e-7)
    assert split.loss == pytest.approx(whole.loss, rel=1e-5, abs=1e-7)
    assert len(split.parts) == 3 and [list(t) for t in split.trained] == [[0, 1], [2, 3, 4], [5]]


def test_rows_the_observer_drops_train_nothing_and_an_undo_cancels() -> None:
    toy = Toy(_batch())
    _run(toy, [[0, 1, 2]])
    g_first = toy.grad()
    seen: list[list[int]] = []

    def drop_second_group(idx: np.ndarray, logp: torch.Tensor) -> np.ndarray:
        seen.append(list(idx))
        assert logp.shape == (len(idx), toy.batch.width)
        return (idx < 3).astype(np.float32)

    acc = _run(toy, [[0, 1, 2], [3, 4, 5]], observe=drop_second_group)
    assert seen == [[0, 1, 2], [3, 4, 5]]
    assert [list(t) for t in acc.trained] == [[0, 1, 2], []]
    np.testing.assert_allclose(toy.grad(), g_first, rtol=1e-6, atol=1e-8)

    _run(toy, [[0, 1, 2, 3, 4, 5]])
    undo = _run(toy, [[3, 4, 5]], sign=-1.0)
    np.testing.assert_allclose(toy.grad(), g_first, rtol=1e-5, atol=1e-7)
    assert undo.loss == pytest.approx(-_run(toy, [[3, 4, 5]]).loss)


def test_without_old_logprobs_the_step_is_on_policy() -> None:
    """Ratio 1 everywhere: the loss's ratio diagnostics sit at 1 and nothing is clipped."""
    toy = Toy(_batch())
    toy.batch.old_logp = None
    acc = _run(toy, [[0, 1, 2, 3, 4, 5]])
    m = acc.parts[0]
    assert m["ratio_mean"] == pytest.approx(1.0) and m["clip_frac_low"] == 0.0 and m["clip_frac_high"] == 0.0
    assert np.abs(toy.grad()).max() > 0


def test_echo_step_settings() -> None:
    plain = _batch()
    off = echo_step(plain, ALGO, 0.3)
    assert not off.echo and not off.hits and off.scored is plain.mask
    roles = np.array([ROLE_ACTION, ROLE_MASKED, ROLE_ECHO, ROLE_ACTION])
    t = Trajectory.multi_turn([1], [4, 5, 6, 7], roles, [-0.5] * 4, 1.0, "stop", np.array([0, -1, -1, 1]))
    u = Trajectory.multi_turn([1], [4, 5, 6, 8], roles, [-0.5] * 4, 0.0, "stop", np.array([0, -1, -1, 1]))
    mt = build_batch([[t, u]], ALGO)
    on = echo_step(mt, ALGO, 0.3)
    assert on.echo and on.hits and on.alpha == 0.3
    np.testing.assert_array_equal(on.scored, np.maximum(mt.mask, mt.echo_mask))
    assert on.scored[0, 2] == 1 and mt.mask[0, 2] == 0
    zero = echo_step(mt, ALGO, 0.0)
    assert zero.echo and not zero.hits
    assert not echo_step(mt, ALGO, None).hits  # the algorithm's constant: 0 in the grpo preset
