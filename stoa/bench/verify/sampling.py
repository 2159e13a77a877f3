"""Honest and lying workers for ``stoa bench verify``: sample with a worker engine holding the published plane,
recompute with the trainer's ``Policy`` (fp32 or bf16 autocast), and score each record (group) the way the
trainer's sequential test does (``stoa.trainer.sequential.record_score``)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stoa.engines import make_engine
from stoa.models import resolve_model
from stoa.tasks import get_task
from stoa.tokenize import TextCodec
from stoa.trainer.quarantine import disagreement_values
from stoa.trainer.sequential import record_score
from stoa.weights.planes import bf16_bits_to_f32, f32_to_bf16_bits

Lie = Callable[[list[np.ndarray], np.random.Generator], list[np.ndarray]]
"""Replaces a group's recorded logprobs (a liar that edits what it reports)."""


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


def noisy(master: dict[str, np.ndarray], scale: float, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``master`` + N(0, scale x each tensor's std) (weight-noise attack; scale 1 on a fresh draw: model swap).

    Args:
        master: float32 weights.
        scale: noise relative to each tensor's standard deviation.
        rng: noise source.
    """
    return {k: (v + rng.normal(0, scale * float(v.std()), v.shape)).astype(np.float32) for k, v in master.items()}


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
               temperature: float) -> tuple[list[Group], float]:
        """``batches`` batches of groups from a worker engine holding ``state``; and the seconds taken.

        Args:
            engine: ``torch`` or ``mlx``.
            dtype: its compute dtype.
            state: the published plane state.
            plane: its plane.
            batches: how many batches of ``--groups`` groups.
            temperature: sampling temperature.
        """

        t0 = time.perf_counter()
        eng = make_engine(engine, self.model_dir, dtype=dtype, device="cpu", plane=plane)
        eng.load_state(state, plane)
        a, out = self.args, []
        for b in range(batches):
            prompts = self.prompts(b)
            groups, _ = eng.generate(prompts, a.n_samples, max_new_tokens=a.max_new_tokens, temperature=temperature,
                                     top_p=1.0, eos_ids=self.eos, generator=eng.make_generator(a.seed + b))
            out += [Group(p, [np.asarray(c.tokens, np.int32) for c in g], [np.asarray(c.logprobs, np.float32)
                                                                          for c in g])
                    for p, g in zip(prompts, groups, strict=True)]
        return out, time.perf_counter() - t0

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
        import torch

        from stoa.engines.torch_scoring import pack_tensors

        rng = np.random.default_rng(seed)
        self.policy.autocast = autocast
        out = np.zeros(len(groups), np.float64)
        chunk = 16
        for i in range(0, len(groups), chunk):
            part = groups[i:i + chunk]
            prompts = [np.asarray(g.prompt) for g in part for _ in g.tokens]
            comps = [c for g in part for c in g.tokens]
            with torch.no_grad():
                lp = self.policy.logprobs(pack_tensors(prompts, comps, max(len(c) for c in comps),
                                                       self.policy.device)).float().cpu().numpy()
            row = 0
            for j, g in enumerate(part):
                recorded = lie(g.logprobs, rng) if lie else g.logprobs
                vals = [disagreement_values(r, lp[row + k, :len(c)]) for k, (r, c) in
                        enumerate(zip(recorded, g.tokens, strict=True))]
                row += len(g.tokens)
                out[i + j] = record_score(np.concatenate(vals), cap)
        self.policy.autocast = False
        return out


def logprob_noise(sigma: float) -> Lie:
    """A liar that reports its logprobs + N(0, sigma), kept <= 0."""
    def lie(lps: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
        return [np.minimum(x + rng.normal(0, sigma, x.shape), 0.0).astype(np.float32) for x in lps]
    return lie


def attack_plan(a: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """The attacks run: label and how (``temperature``, ``weights`` noise scale, ``swap``, ``lie``)."""
    return [("sampling at T x 0.8", {"temperature": 0.8}), ("sampling at T x 0.9", {"temperature": 0.9}),
            ("logprobs + N(0, 0.1)", {"lie": logprob_noise(0.1)}), ("weights + 1% noise", {"weights": 0.01}),
            ("weights + 2% noise", {"weights": 0.02}), ("model swap (another init)", {"swap": True})]
