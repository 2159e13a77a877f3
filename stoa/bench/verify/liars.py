"""The lying workers of ``stoa bench verify`` whose lie shows only in the logprobs: what each samples with and what
it reports. Each attack is a ``How``: a weight change (noise, another init, a lower-precision base), a sampler change
(temperature, top-p, top-k) or a change of the reported logprobs (noise, another model's, another record's)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from stoa.weights.planes import is_quantized_name

Lie = Callable[[list[np.ndarray], np.random.Generator], list[np.ndarray]]
"""Replaces a group's recorded logprobs (a liar that edits what it reports)."""


@dataclass(frozen=True)
class How:
    """How one attack lies; the defaults are an honest worker.

    Args:
        temperature: factor on the run's temperature the liar samples at.
        top_p: the nucleus the liar samples with (the contract's is 1).
        top_k: sample from the k most likely tokens only (0: all).
        weights: relative weight noise (``noisy``).
        swap: sample with another init (model swap).
        bits: sample with a ``bits``-bit group-affine base (``quantized``) on the run's plane (0: the plane).
        plane: hold this weight plane instead of ``--liar-plane`` ("": the liar plane).
        lie: replaces each group's recorded logprobs.
        foreign: report the logprobs another init computes for the sampled tokens.
        copied: report the logprobs of the next record (cut or padded to each sample's length).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    weights: float = 0.0
    swap: bool = False
    bits: int = 0
    plane: str = ""
    lie: Lie | None = None
    foreign: bool = False
    copied: bool = False


def logprob_noise(sigma: float) -> Lie:
    """A liar that reports its logprobs + N(0, sigma), kept <= 0."""
    def lie(lps: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
        return [np.minimum(x + rng.normal(0, sigma, x.shape), 0.0).astype(np.float32) for x in lps]
    return lie


def attack_plan(a: argparse.Namespace) -> list[tuple[str, How]]:
    """The attacks run, numbered from 1 in this order (``--attacks``): label and how."""
    del a  # the plan is fixed; kept for callers that pass their flags
    return [("sampling at T x 0.8", How(temperature=0.8)), ("sampling at T x 0.9", How(temperature=0.9)),
            ("logprobs + N(0, 0.1)", How(lie=logprob_noise(0.1))), ("weights + 1% noise", How(weights=0.01)),
            ("weights + 2% noise", How(weights=0.02)), ("model swap (another init)", How(swap=True)),
            ("sampling with top-p 0.9", How(top_p=0.9)), ("sampling with top-k 50", How(top_k=50)),
            ("int8g64 base on the bf16 plane", How(plane="int8g64")),
            ("4-bit g64 base (MLX-style)", How(bits=4)),
            ("logprobs of another model", How(foreign=True)),
            ("logprobs copied from another record", How(copied=True))]


def noisy(master: dict[str, np.ndarray], scale: float, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``master`` + N(0, scale x each tensor's std) (weight-noise attack).

    Args:
        master: float32 weights.
        scale: noise relative to each tensor's standard deviation.
        rng: noise source.
    """
    return {k: (v + rng.normal(0, scale * float(v.std()), v.shape)).astype(np.float32) for k, v in master.items()}


def swapped(master: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Another init of the same shapes: each tensor redrawn from N(its mean, its std) (model swap)."""
    return {k: (v.mean() + rng.normal(0, float(v.std()), v.shape)).astype(np.float32) for k, v in master.items()}


def quantized(master: dict[str, np.ndarray], bits: int, group: int = 64) -> dict[str, np.ndarray]:
    """``master`` with every tensor the int8g64 plane quantizes rounded to ``bits``-bit affine codes per group of
    ``group`` (a scale and a bias per group, as an MLX 4-bit checkpoint), back in float32.

    Args:
        master: float32 weights.
        bits: code width.
        group: values per scale along the last axis.
    """
    out, top = {}, float(2 ** bits - 1)
    for k, v in master.items():
        if not is_quantized_name(k, v.shape) or v.shape[-1] % group:
            out[k] = v
            continue
        g = v.reshape(-1, group).astype(np.float64)
        lo, hi = g.min(axis=1, keepdims=True), g.max(axis=1, keepdims=True)
        scale = np.where(hi > lo, (hi - lo) / top, 1.0)
        out[k] = (np.round((g - lo) / scale) * scale + lo).reshape(v.shape).astype(np.float32)
    return out


def copied_logprobs(groups: list, rng: np.random.Generator) -> list[list[np.ndarray]]:
    """Per group, the logprobs of the next group's samples, cut or padded (with their last value) to each sample's
    length (a worker that pastes logprobs from another of its records)."""
    del rng
    out = []
    for i, g in enumerate(groups):
        donor = groups[(i + 1) % len(groups)].logprobs
        out.append([_fit(donor[j % len(donor)], len(t)) for j, t in enumerate(g.tokens)])
    return out


def _fit(x: np.ndarray, n: int) -> np.ndarray:
    if x.size >= n:
        return x[:n].astype(np.float32)
    pad = x[-1] if x.size else np.float32(-1.0)
    return np.concatenate([x, np.full(n - x.size, pad, np.float32)]).astype(np.float32)


@contextlib.contextmanager
def top_k_sampler(k: int) -> Iterator[None]:
    """Inside, the torch engine samples from each step's ``k`` most likely tokens, renormalised (a tampered engine:
    the recorded logprobs are the truncated distribution's)."""
    if k <= 0:
        yield
        return
    import torch

    import stoa.engines.torch as engine

    honest = engine.sampling_logprobs_torch

    def tampered(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
        z = logits.float()
        kth = torch.topk(z, min(k, z.shape[-1]), dim=-1).values[..., -1:]
        return honest(z.masked_fill(z < kth, float("-inf")), temperature, top_p)

    engine.sampling_logprobs_torch = tampered
    try:
        yield
    finally:
        engine.sampling_logprobs_torch = honest
