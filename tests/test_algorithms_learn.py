"""Every algorithm raises the reward of a tiny model on the toy task through the real trainer step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stoa.algorithms import AlgoConfig, get_algorithm
from stoa.engines.torch import TorchEngine
from stoa.rollouts.records import RolloutRecord, Sample
from stoa.tasks import get_task
from stoa.tokenize import TextCodec
from stoa.trainer.policy import Policy
from stoa.trainer.pool import Entry
from stoa.trainer.step import train_step


def run(tiny_dir, name: str, steps: int = 14, lr: float = 3e-2) -> list[float]:
    torch.manual_seed(0)
    codec = TextCodec(tiny_dir)
    policy = Policy(tiny_dir, torch.device("cpu"))
    engine = TorchEngine.from_model(policy.model)
    algo = get_algorithm(AlgoConfig.from_dict({"name": name, "kl_beta": 0.0, "max_tokens": 8}), "torch")
    opt = torch.optim.AdamW(policy.model.parameters(), lr=lr, weight_decay=0.0)
    task, rng, gen = get_task("toy"), np.random.default_rng(0), torch.Generator().manual_seed(0)
    means = []
    for _ in range(steps):
        prompts = [task.sample_train(rng) for _ in range(4)]
        ids = [codec.encode_prompt(p.messages) for p in prompts]
        groups, _ = engine.generate(ids, 4, max_new_tokens=8, eos_ids=codec.eos_ids, generator=gen)
        policy.model.train()
        entries = []
        for p, i, g in zip(prompts, ids, groups, strict=True):
            samples = [Sample(np.array(c.tokens, np.int32), np.array(c.logprobs, np.float32),
                              task.reward(p, codec.decode(c.tokens)), c.finish_reason) for c in g]
            rec = RolloutRecord("w", 0, 1, "f", "toy", p.id, np.array(i, np.int32), samples)
            entries.append(Entry(p.id, rec, np.array([s.reward for s in samples], np.float32)))
        means.append(float(np.mean([e.rewards.mean() for e in entries])))
        kept = [e for e in entries if algo.keep_groups(e.rewards[None, :])[0]]
        if kept:
            train_step(policy, None, opt, algo, kept, current_version=1, micro_batch=16, grad_clip=1.0)
    return means


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "gspo", "rloo", "cispo"])
def test_reward_rises(tiny_dir, name):
    means = run(tiny_dir, name)
    assert np.mean(means[-4:]) > np.mean(means[:4]) + 0.1, np.round(means, 3)
