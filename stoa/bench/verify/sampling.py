"""Honest and lying workers for ``stoa bench verify``: sample with a worker engine holding the published plane,
recompute with the trainer's ``Policy`` (fp32 or bf16 autocast), and score each record (group) the way the
trainer's sequential test does (``stoa.trainer.sequential.record_score``)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stoa.bench.verify.liars import Lie
from stoa.engines import make_engine
from stoa.models import resolve_model
from stoa.tasks import get_task
from stoa.tokenize import TextCodec
from stoa.trainer.quarantine import disagreement_values
from stoa.trainer.sequential import record_score
from stoa.weights.planes import bf16_bits_to_f32, f32_to_bf16_bits, state_from_f32


@dataclass(frozen=True)
class Group:
    """One record: its prompt, completions and recorded logprobs."""

    prompt: list[int]
    tokens: list[np.ndarray]
    logprobs: list[np.ndarray]


def offgrid(named: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Move every weight a uniform fraction of a bf16 ulp off its bf16 rounding, as a trained master is
    (the same as ``stoa bench quarantine``).

    Args:
        named: float32 weights.
        rng: jitter source.
    """

    out = {}
    for k, w in named.items():
        on = bf16_bits_to_f32(f32_to_bf16_bits(np.asarray(w, np.float32)))
        _, exp = np.frexp(on)
        ulp = np.ldexp(np.ones_like(on), exp - 8)
        jitter = rng.uniform(-0.49, 0.49, size=on.shape).astype(np.float32) * ulp
        out[k] = np.where(on == 0, on, on + jitter).astype(np.float32)
    return out


class Rig:
    """The trainer's policy with an off-grid master, the prompts, and the engines' sampling.

    Args:
        args: ``stoa bench verify`` flags.
    """

    def __init__(self, args: argparse.Namespace):
        import torch

        from stoa.trainer.policy import Policy

        self.args = args
        self.model_dir = Path(resolve_model(args.model))
        self.policy = Policy(self.model_dir, torch.device("cpu"), temperature=args.temperature, trainable=False)
        self.master = offgrid(self.policy.export_f32(), np.random.default_rng(args.seed))
        self.policy.load_f32(self.master)
        codec = TextCodec(self.model_dir)
        self.task, self.codec, self.eos = get_task("arithmetic"), codec, list(codec.eos_ids)

    def prompts(self, batch: int) -> list[list[int]]:
        """The prompts of batch ``batch`` (the same for every engine)."""
        rngs = [np.random.default_rng([self.args.seed, batch, g]) for g in range(self.args.groups)]
        return [self.codec.encode_prompt(self.task.sample_train(r).messages) for r in rngs]

    def sample(self, engine: str, dtype: str, state: dict[str, np.ndarray], plane: str, batches: int,
               temperature: float, top_p: float = 1.0) -> tuple[list[Group], float]:
        """``batches`` batches of groups from a worker engine holding ``state``; and the seconds taken.

        Args:
            engine: ``torch`` or ``mlx``.
            dtype: its compute dtype.
            state: the published plane state.
            plane: its plane.
            batches: how many batches of ``--groups`` groups.
            temperature: sampling temperature.
            top_p: nucleus mass.
        """

        t0 = time.perf_counter()
        eng = self.worker(engine, dtype, state, plane)
        a, out = self.args, []
        for b in range(batches):
            prompts = self.prompts(b)
            groups, _ = eng.generate(prompts, a.n_samples, max_new_tokens=a.max_new_tokens, temperature=temperature,
                                     top_p=top_p, eos_ids=self.eos, generator=eng.make_generator(a.seed + b))
            out += [Group(p, [np.asarray(c.tokens, np.int32) for c in g], [np.asarray(c.logprobs, np.float32)
                                                                          for c in g])
                    for p, g in zip(prompts, groups, strict=True)]
        return out, time.perf_counter() - t0

    def state(self, plane: str) -> dict[str, np.ndarray]:
        """What an honest worker on ``plane`` loads: the master's stored bits."""
        return state_from_f32(self.master, plane)

    def label(self, plane: str) -> str:
        """``plane`` as the tables name it."""
        return plane

    def worker(self, engine: str, dtype: str, state: dict[str, np.ndarray], plane: str) -> Any:
        """A worker engine holding ``state`` (a LoRA rig's adds the run's adapter: ``stoa.bench.verify.lora``).

        Args:
            engine: ``torch`` or ``mlx``.
            dtype: its compute dtype.
            state: the published plane state.
            plane: its plane.
        """
        eng = make_engine(engine, self.model_dir, dtype=dtype, device="cpu", plane=plane)
        eng.load_state(state, plane)
        return eng

    def scores(self, groups: list[Group], autocast: bool, cap: float, lie: Lie | None = None,
               seed: int = 0) -> np.ndarray:
        """Each group's record score against the trainer's recompute (fp32, or bf16 autocast).

        Args:
            groups: sampled records.
            autocast: recompute under bf16 autocast (the trainer on CUDA).
            cap: the score's cap.
            lie: replaces each group's recorded logprobs (None: as sampled).
            seed: the lie's noise seed.
        """
        out = np.zeros(len(groups), np.float64)
        for i, diffs in enumerate(self.residuals(groups, autocast, lie, seed)):
            d = np.concatenate(diffs)
            out[i] = record_score(disagreement_values(d, np.zeros_like(d)), cap)
        return out

    def rounding(self, groups: list[Group], cap: float) -> np.ndarray:
        """Each group's record score between the trainer policy's fp32 and bf16-autocast logprobs of its tokens: the
        trainer's rounding probe (``stoa.trainer.rounding``) on these records.

        Args:
            groups: sampled records.
            cap: the score's cap.
        """
        out, chunk = [], 16
        for i in range(0, len(groups), chunk):
            part = groups[i:i + chunk]
            fp32, bf16, row = self.recompute(part), self.recompute(part, True), 0
            for g in part:
                d = np.concatenate([fp32[row + k, :len(c)].astype(np.float64) - bf16[row + k, :len(c)]
                                    for k, c in enumerate(g.tokens)])
                out.append(record_score(disagreement_values(d, np.zeros_like(d)), cap))
                row += len(g.tokens)
        return np.array(out, np.float64)

    def residuals(self, groups: list[Group], autocast: bool, lie: Lie | None = None,
                  seed: int = 0) -> Iterator[list[np.ndarray]]:
        """Per group, per sample: ``recorded - recomputed`` logprob of each token (float64; the trainer's
        ``disagreement_values`` of it is ``exp|d| - 1``).

        Args:
            groups: sampled records.
            autocast: recompute under bf16 autocast (the trainer on CUDA).
            lie: replaces each group's recorded logprobs (None: as sampled).
            seed: the lie's noise seed.
        """
        rng = np.random.default_rng(seed)
        chunk = 16
        for i in range(0, len(groups), chunk):
            part = groups[i:i + chunk]
            lp = self.recompute(part, autocast)
            row = 0
            for g in part:
                recorded = lie(g.logprobs, rng) if lie else g.logprobs
                yield [np.asarray(r, np.float64) - np.asarray(lp[row + k, :len(c)], np.float64)
                       for k, (r, c) in enumerate(zip(recorded, g.tokens, strict=True))]
                row += len(g.tokens)

    def recompute(self, part: list[Group], autocast: bool = False) -> np.ndarray:
        """The trainer policy's logprobs of ``part``'s completions, one row per sample (float32 [rows, T]).

        Args:
            part: records.
            autocast: under bf16 autocast.
        """
        import torch

        from stoa.engines.torch_scoring import pack_tensors

        prompts = [np.asarray(g.prompt) for g in part for _ in g.tokens]
        comps = [c for g in part for c in g.tokens]
        self.policy.autocast = autocast
        try:
            with torch.no_grad():
                return self.policy.logprobs(pack_tensors(prompts, comps, max(len(c) for c in comps),
                                                         self.policy.device)).float().cpu().numpy()
        finally:
            self.policy.autocast = False

    def rescored(self, groups: list[Group], master: dict[str, np.ndarray]) -> list[Group]:
        """``groups`` with the logprobs the trainer's policy computes for their tokens with ``master`` (fp32); the
        policy holds the rig's master again after.

        Args:
            groups: sampled records.
            master: float32 weights of the model whose logprobs are reported.
        """
        self.policy.load_f32(master)
        out, chunk = [], 16
        try:
            for i in range(0, len(groups), chunk):
                part = groups[i:i + chunk]
                lp, row = self.recompute(part), 0
                for g in part:
                    out.append(Group(g.prompt, g.tokens, [lp[row + k, :len(c)].astype(np.float32)
                                                          for k, c in enumerate(g.tokens)]))
                    row += len(g.tokens)
        finally:
            self.policy.load_f32(self.master)
        return out
