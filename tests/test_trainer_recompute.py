"""The step's per-sample recompute check: a lag-0 group with a sample whose recorded logprobs are far from the
trainer's trains nothing (in every forward mode, a group split over micro-batches included) and is counted."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stoa.algorithms import AlgoConfig, get_algorithm
from stoa.layout import rollout_key
from stoa.rollouts.records import RolloutRecord, Sample
from stoa.trainer.policy import Policy
from stoa.trainer.pool import Entry, PoolStats
from stoa.trainer.recompute_check import RECOMPUTE_LIMIT, RecomputeCheck, sample_medians
from stoa.trainer.step import train_step
from stoa.trainer.steplog import step_row

LENGTHS = [[9, 8, 7, 2], [6, 6, 5, 5], [4, 9, 3, 8]]
"""Group 0's last sample is its shortest: packed longest-first, its other rows train in an earlier micro-batch."""


def honest_entries(tiny_dir, forged: int | None = None, version: int = 1) -> list[Entry]:
    """Three groups whose logprobs are the trainer's own; ``forged``: that group's shortest sample's logprobs
    are made up (-0.5 a token, as a forger writes them)."""
    rng = np.random.default_rng(0)
    pol = Policy(tiny_dir, torch.device("cpu"), trainable=False)
    out = []
    for g, lengths in enumerate(LENGTHS):
        prompt = rng.integers(3, 500, size=6).astype(np.int32)
        toks = [rng.integers(3, 500, size=n).astype(np.int32) for n in lengths]
        with torch.no_grad():
            lp = pol.group_logprobs(prompt, toks, max(lengths)).numpy()
        samples = [Sample(t, lp[i, : t.size].astype(np.float32), float(i % 2), "length") for i, t in enumerate(toks)]
        if g == forged:
            samples[int(np.argmin(lengths))].logprobs[:] = -0.5
        rec = RolloutRecord("w", g, version, "f", "toy", f"train:{g}", prompt, samples)
        out.append(Entry(rollout_key("r", version, "w", g), rec, np.array([s.reward for s in samples], np.float32)))
    return out


def step(tiny_dir, entries, **kw):
    torch.manual_seed(0)
    pol = Policy(tiny_dir, torch.device("cpu"))
    before = {k: v.detach().clone() for k, v in pol.model.named_parameters()}
    algo = get_algorithm(AlgoConfig.from_dict({"name": "grpo", "kl_beta": 0.0}), "torch")
    m = train_step(pol, None, torch.optim.SGD(pol.model.parameters(), lr=1.0), algo, entries, current_version=1,
                   grad_clip=0.0, **kw)
    return m, {k: v.detach() - before[k] for k, v in pol.model.named_parameters()}


@pytest.mark.parametrize("mode", [dict(shared_prefix=True, micro_batch=4), dict(shared_prefix=False, micro_batch=3),
                                  dict(shared_prefix=False, micro_batch=100)])
def test_a_forged_sample_drops_its_group_from_the_update(tiny_dir, mode):
    m, delta = step(tiny_dir, honest_entries(tiny_dir, forged=0), **mode)
    assert m.rejected == {"recompute": 1} and math.isfinite(m["loss"])
    assert m["recompute_median_max"] > RECOMPUTE_LIMIT
    # The reference: the same group with zero advantages (equal rewards) contributes nothing, as rejected rows must.
    ref_entries = honest_entries(tiny_dir)
    ref_entries[0].rewards[:] = 0.5
    ref_m, ref = step(tiny_dir, ref_entries, **mode)
    assert ref_m.rejected == {} and ref_m["recompute_median_max"] < 1e-3  # the trainer's own logprobs
    assert max(float(v.abs().max()) for v in ref.values()) > 0
    for k in ref:
        torch.testing.assert_close(delta[k], ref[k], atol=2e-6, rtol=1e-4)


def test_honest_and_lagged_groups_are_never_judged_out(tiny_dir):
    m, _ = step(tiny_dir, honest_entries(tiny_dir), shared_prefix=False, micro_batch=3)
    assert m.rejected == {}
    lagged = honest_entries(tiny_dir, forged=0)
    for e in lagged:
        e.record.policy_version = 0  # lag 1: an older policy's logprobs are the ratio's business
    m, _ = step(tiny_dir, lagged, shared_prefix=True, micro_batch=4)
    assert m.rejected == {} and m["recompute_median_max"] == 0.0


def test_the_step_row_counts_the_rejection_under_rollout_rejected(tiny_dir):
    entries = honest_entries(tiny_dir, forged=2)
    m, _ = step(tiny_dir, entries, shared_prefix=True, micro_batch=4)
    ps = PoolStats()
    ps.rejected["observation"] += 2
    row = step_row(entries, m, ps, version=2, staleness_bound=1, since_s=1.0)
    assert row["rollout/rejected/recompute"] == 1 and row["rollout/rejected/observation"] == 2


def test_sample_medians_and_limits():
    rec = np.log(np.array([[0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]]))
    got = rec + np.array([[0.0, 0.01, -0.01, 9.0], [0.0, 0.6, -0.6, 0.6], [np.nan, np.nan, 0.0, 0.0]])
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]], np.float32)
    med = sample_medians(rec, got, mask)
    np.testing.assert_allclose(med[:2], [math.expm1(0.01), math.expm1(0.6)])
    assert med[2] == np.inf or med[2] > 1e300  # a recompute that overflowed counts as far off
    check = RecomputeCheck(np.array([0, 1, 2]), np.array([0, 0, 0]))
    check.judge(np.arange(3), rec, got, mask)
    assert check.rejected == {2} and check.limit == RECOMPUTE_LIMIT  # a median |d| of 0.6: honest-sized
    under, over = math.log1p(RECOMPUTE_LIMIT) - 0.01, math.log1p(RECOMPUTE_LIMIT) + 0.01
    check.judge(np.arange(3), rec, rec + under, mask)
    assert check.rejected == {2}
    check.judge(np.arange(3), rec, rec - over, mask)
    assert check.rejected == {0, 1, 2}
    cool = RecomputeCheck(np.array([0]), np.array([0]), temperature=0.5, top_p=0.9)
    assert cool.limit == pytest.approx(math.exp(math.log1p(RECOMPUTE_LIMIT) / 0.5) / 0.9 - 1)
    off = RecomputeCheck(np.array([0]), np.array([0]), limit=float("inf"))
    off.judge(np.arange(1), rec[:1], rec[:1] + 50.0, mask[:1])
    assert off.rejected == set()
    np.testing.assert_array_equal(check.keep(np.array([2, 1])), [0.0, 0.0])
