"""The trainer step: shared-prefix and packed paths, and micro-batching, give the same update."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stoa.algorithms import AlgoConfig, get_algorithm
from stoa.engines.torch_scoring import pack_tensors
from stoa.layout import rollout_key
from stoa.rollouts.records import RolloutRecord, Sample
from stoa.trainer.policy import Policy
from stoa.trainer.pool import Entry
from stoa.trainer.step import entries_batch, train_step


def make_entries(seed: int = 0, groups: int = 3, n: int = 4) -> list[Entry]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(3, 500, size=int(rng.integers(5, 12))).astype(np.int32)
        samples = []
        for _ in range(n):
            t = int(rng.integers(1, 7))
            samples.append(Sample(rng.integers(3, 500, size=t).astype(np.int32),
                                  (-rng.random(t) * 6).astype(np.float32), float(rng.random()), "length"))
        rec = RolloutRecord("w", g, 1, "f", "toy", f"train:{g}", prompt, samples)
        out.append(Entry(f"k{g}", rec, np.array([s.reward for s in samples], np.float32)))
    return out


def step_delta(tiny_dir, algo_name: str, **kw) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    pol = Policy(tiny_dir, torch.device("cpu"))
    before = {k: v.detach().clone() for k, v in pol.model.named_parameters()}
    opt = torch.optim.SGD(pol.model.parameters(), lr=1.0)
    cfg = AlgoConfig.from_dict({"name": algo_name, "kl_beta": 0.0, "max_tokens": 6})
    m = train_step(pol, None, opt, get_algorithm(cfg, "torch"), make_entries(), current_version=2,
                   grad_clip=0.0, **kw)
    assert np.isfinite(m["loss"]) and m["tokens"] > 0
    return {k: v.detach() - before[k] for k, v in pol.model.named_parameters()}


@pytest.mark.parametrize("algo", ["grpo", "dr_grpo", "gspo"])
def test_shared_prefix_equals_packed_and_micro_batches_equal_whole(tiny_dir, algo):
    shared = step_delta(tiny_dir, algo, micro_batch=4, shared_prefix=True)
    whole = step_delta(tiny_dir, algo, micro_batch=100, shared_prefix=False)
    micro = step_delta(tiny_dir, algo, micro_batch=3, shared_prefix=False)
    assert max(float(v.abs().max()) for v in whole.values()) > 0
    for k in whole:
        torch.testing.assert_close(shared[k], whole[k], atol=2e-6, rtol=1e-4)
        torch.testing.assert_close(micro[k], whole[k], atol=2e-6, rtol=1e-4)


def test_group_logprobs_equal_packed_logprobs(tiny_dir):
    pol = Policy(tiny_dir, torch.device("cpu"), temperature=0.7)
    e = make_entries(1)[0]
    comps = [s.tokens for s in e.record.samples]
    a = pol.group_logprobs(e.record.prompt_tokens, comps, 6)
    b = pol.logprobs(pack_tensors([e.record.prompt_tokens] * len(comps), comps, 6, torch.device("cpu")))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_entries_batch_carries_pool_rewards_lags_workers_and_recorded_logprobs():
    entries = make_entries(groups=2, n=3)  # records of version 1; keys that are not record keys
    e = entries[1]
    entries[1] = Entry(rollout_key("r", 1, "w-b", 7), e.record, e.rewards + 1.0)  # the pool's rewards differ
    algo = get_algorithm(AlgoConfig.from_dict({"name": "grpo", "kl_beta": 0.0}), "torch")
    b = entries_batch(entries, algo, current_version=3)
    assert b.version_lag.tolist() == [2] * 6
    # the key's worker, else (not a record key) the record's worker_id
    assert b.sources == ["w"] * 3 + ["w-b"] * 3
    np.testing.assert_array_equal(b.rewards, np.stack([entries[0].rewards, entries[1].rewards]))
    assert b.old_logp is b.rollout_logp
    for i, s in enumerate(s for en in entries for s in en.record.samples):
        np.testing.assert_array_equal(b.old_logp[i, : len(s.tokens)], s.logprobs)
        assert not b.old_logp[i, len(s.tokens) :].any()


@pytest.mark.parametrize(("shared_prefix", "micro_batch", "forwards"),
                         [(False, 5, 3), (False, 100, 1), (True, 5, 3)])
def test_micro_batches_are_the_forwards(tiny_dir, monkeypatch, shared_prefix, micro_batch, forwards):
    """12 rows: packed chunks of ``micro_batch`` rows, longest first; shared-prefix: one forward per group."""
    pol = Policy(tiny_dir, torch.device("cpu"))
    sizes: list[int] = []
    real = pol.group_logprobs if shared_prefix else pol.logprobs

    def counted(*args):
        out = real(*args)
        sizes.append(out.shape[0])
        return out

    monkeypatch.setattr(pol, "group_logprobs" if shared_prefix else "logprobs", counted)
    algo = get_algorithm(AlgoConfig.from_dict({"name": "grpo", "kl_beta": 0.0}), "torch")
    opt = torch.optim.SGD(pol.model.parameters(), lr=0.1)
    train_step(pol, None, opt, algo, make_entries(), current_version=1, micro_batch=micro_batch,
               grad_clip=0.0, shared_prefix=shared_prefix)
    assert len(sizes) == forwards and sum(sizes) == 12


def test_single_turn_steps_ignore_the_echo_settings(tiny_dir):
    """No echo token in the batch: an ECHO config (even a taper without total steps) changes nothing."""
    def run(**knobs):
        torch.manual_seed(0)
        pol = Policy(tiny_dir, torch.device("cpu"))
        opt = torch.optim.SGD(pol.model.parameters(), lr=1.0)
        algo = get_algorithm(AlgoConfig.from_dict({"name": "grpo", "kl_beta": 0.0, **knobs}), "torch")
        m = train_step(pol, None, opt, algo, make_entries(), current_version=2, micro_batch=5, grad_clip=0.0,
                       shared_prefix=False, step=3)
        return m, {k: v.detach().clone() for k, v in pol.model.named_parameters()}

    plain_m, plain = run()
    echo_m, echo = run(echo_alpha=0.5, echo_schedule="linear_taper_to_zero")
    assert all(torch.equal(plain[k], echo[k]) for k in plain)
    assert set(echo_m) == set(plain_m) and not {"echo_alpha", "loss_echo", "echo_acc"} & set(echo_m)
    assert echo_m["loss"] == plain_m["loss"]
