"""The MLX side of the sampling distribution (temperature, then top-p) and one decode step's draw."""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np


def sampling_logprobs_mlx(logits: mx.array, temperature: float, top_p: float) -> mx.array:
    """Log-probabilities of the sampling distribution (temperature, then top-p, renormalised), float32.

    Mirrors ``stoa.engines.sampling.sampling_logprobs_np``: the nucleus is the smallest set of most likely
    tokens whose mass reaches ``top_p`` (the crossing token kept); among tokens of equal probability at the
    edge, lower ids are kept first (numpy's stable sort), whatever the backend's sort does with ties.

    Args:
        logits: [N, V] logits of any float dtype.
        temperature: divides the logits (> 0).
        top_p: nucleus mass in (0, 1].
    """
    z = logits.astype(mx.float32) / temperature
    logp = z - mx.logsumexp(z, axis=-1, keepdims=True)
    if top_p >= 1.0:
        return logp
    sorted_lp = -mx.sort(-logp, axis=-1)
    sorted_p = mx.exp(sorted_lp)
    before = mx.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly before each sorted position
    keep_count = mx.sum(before < top_p, axis=-1, keepdims=True)  # >= 1: before[0] = 0 < top_p
    edge = mx.take_along_axis(sorted_lp, keep_count - 1, axis=-1)  # logprob of the last kept token
    above = logp > edge
    tied = logp == edge
    tie_rank = mx.cumsum(tied.astype(mx.int32), axis=-1)  # 1-based rank by token id among the ties
    keep = above | (tied & (tie_rank <= keep_count - mx.sum(above, axis=-1, keepdims=True)))
    kept = mx.where(keep, logp, -mx.inf)
    return kept - mx.logsumexp(kept, axis=-1, keepdims=True)


def make_key(generator: int | mx.array | None) -> mx.array | None:
    """Turn ``generate``'s ``generator`` into an ``mx.random`` key (None: MLX's global random state).

    Args:
        generator: an int seed, a key from ``mx.random.key``, or None.
    """
    if generator is None:
        return None
    if isinstance(generator, mx.array):
        return generator
    if isinstance(generator, int | np.integer) and not isinstance(generator, bool):
        return mx.random.key(int(generator))
    raise TypeError(f"generator must be an int seed, an mx.random key or None, "
                    f"not {type(generator).__name__}")


class Draw(NamedTuple):
    """One decode step's sample (lazy arrays) and the key for the next step."""

    tokens: mx.array
    """[rows] sampled token ids."""
    logprobs: mx.array
    """[rows] their logprobs under the sampling distribution."""
    key: mx.array | None
    """The key the next step draws with (None: MLX's global random state)."""


def draw(logits: mx.array, key: mx.array | None, temperature: float, top_p: float, greedy: bool) -> Draw:
    """Sample one token per row from the temperature/top-p distribution (or take its argmax).

    A key is split once per call (the first half goes on, the second samples), so a seed fixes every step.

    Args:
        logits: [rows, V] last-position logits.
        key: the step's key, or None for MLX's global random state.
        temperature: sampling temperature.
        top_p: nucleus mass.
        greedy: take the argmax; the logprobs stay those of the distribution.
    """
    logp = sampling_logprobs_mlx(logits, temperature, top_p)
    if greedy:
        tok = mx.argmax(logp, axis=-1)
    elif key is None:
        tok = mx.random.categorical(logp)
    else:
        key, sub = mx.random.split(key)
        tok = mx.random.categorical(logp, key=sub)
    lp = mx.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
    return Draw(tok, lp, key)
