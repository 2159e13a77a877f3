"""The PULSE benchmark's training signal: model-sampled completions and one GRPO-style AdamW step."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

GRAD_CLIP = 1.0
"""Global gradient-norm clip, the trainer's default (``TrainerConfig.grad_clip``)."""
SYSTEM = "Answer briefly."
"""System message for chat-templated prompts (keeps SmolLM2's long default system prompt out)."""

PROMPTS = (
    "Tom has 12 apples and gives 5 to Anna. How many apples does Tom have left?",
    "A train travels 60 km per hour for 3 hours. How far does it go?",
    "Sara buys 4 boxes of pencils with 8 pencils in each box. How many pencils does she have?",
    "Half of a number is 21. What is the number?",
)
"""Prompt texts (chat-templated when the tokenizer has a template); one GRPO group each."""


class Rollouts(NamedTuple):
    """One step's sampled rows: prompt and completion token ids, and one advantage per row."""

    prompts: list[np.ndarray]
    completions: list[np.ndarray]
    advantages: list[float]


class Sampler:
    """Model-sampled completions and a GRPO-style policy-gradient step with random balanced advantages.

    Args:
        model_dir: the model directory (its tokenizer renders :data:`PROMPTS`).
        samples: completions per prompt.
        max_new_tokens: completion length cap.
        seed: seed for sampling and advantages.
    """

    def __init__(self, model_dir: Path, samples: int, max_new_tokens: int, seed: int) -> None:
        from transformers import AutoTokenizer

        tok: Any = AutoTokenizer.from_pretrained(model_dir)
        self.eos = tok.eos_token_id
        fallback = self.eos if self.eos is not None else 0
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else fallback
        self.prompts: list[list[int]] = []
        for text in PROMPTS:
            if getattr(tok, "chat_template", None):
                messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
                rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                ids = tok(rendered, add_special_tokens=False)["input_ids"]
            else:
                ids = tok(text)["input_ids"]
            self.prompts.append([int(i) for i in ids])
        self.samples = samples
        self.max_new_tokens = max_new_tokens
        self.seed = seed

    def step(self, policy: Any, opt: Any, step: int) -> dict[str, float]:
        """Sample completions from ``policy`` and take one AdamW step on the policy-gradient loss.

        Loss: ``-sum_i A_i * sum_t logp_it / n_tokens`` over all completions, where each group's
        advantages are a random permutation of half +1, half -1 (a GRPO group with random 0/1
        rewards, normalized). On-policy, so the PPO ratio is 1 and no clipping applies.

        Args:
            policy: a :class:`stoa.trainer.policy.Policy`.
            opt: its AdamW optimizer.
            step: step index (seeds sampling and advantages, so every lr sees the same first samples).
        """
        import torch

        from stoa.engines.torch_scoring import pack_tensors

        t0 = time.perf_counter()
        rows_p, rows_c, adv = self.sample(policy, step)
        t_sample = time.perf_counter() - t0
        t_max = max(len(c) for c in rows_c)
        batch = pack_tensors(rows_p, rows_c, t_max, policy.device)
        logp = policy.logprobs(batch)
        a = torch.tensor(adv, dtype=torch.float32, device=policy.device)
        loss = -(a[:, None] * logp).sum() / batch.mask.sum()
        loss.backward()
        params = [q for q in policy.model.parameters() if q.grad is not None]
        gn = torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {
            "loss": float(loss.detach()),
            "grad_norm": float(gn),
            "tokens": float(batch.mask.sum()),
            "sample_s": t_sample,
            "train_step_s": time.perf_counter() - t0,
        }

    def sample(self, policy: Any, step: int) -> Rollouts:
        """Sample ``samples`` completions of every prompt (cut after the first EOS) and draw their advantages.

        Args:
            policy: a :class:`stoa.trainer.policy.Policy` (its model is put back in training mode after).
            step: step index (seeds sampling and advantages).
        """
        import torch

        rng = np.random.default_rng([self.seed, step])
        model = policy.model
        rows_p: list[np.ndarray] = []
        rows_c: list[np.ndarray] = []
        adv: list[float] = []
        model.eval()
        with torch.no_grad():
            for gi, p in enumerate(self.prompts):
                torch.manual_seed(self.seed * 1_000_003 + step * 1009 + gi)
                ids = torch.tensor([p] * self.samples, dtype=torch.long, device=policy.device)
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                     temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=self.max_new_tokens,
                                     pad_token_id=self.pad, use_cache=True)
                for row in out[:, len(p):].cpu().numpy():
                    cut = len(row)
                    if self.eos is not None and (hits := np.flatnonzero(row == self.eos)).size:
                        cut = int(hits[0]) + 1
                    rows_p.append(np.asarray(p, np.int64))
                    rows_c.append(row[: max(1, cut)].astype(np.int64))
                half = self.samples // 2
                adv.extend(rng.permutation([1.0] * half + [-1.0] * (self.samples - half)).tolist())
        model.train()
        return Rollouts(rows_p, rows_c, adv)
