"""The sampling distribution both engines must agree on: temperature, then top-p, then renormalise."""

from __future__ import annotations

import numpy as np


def sampling_logprobs_np(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """Reference (numpy, float64) log-probabilities of the distribution a worker samples from.

    Tokens outside the nucleus get ``-inf``. The nucleus is the smallest set of most likely
    tokens whose mass reaches ``top_p`` (the token that crosses the threshold is kept).

    Args:
        logits: [..., V] raw logits.
        temperature: divides the logits (> 0).
        top_p: nucleus mass in (0, 1].
    """
    z = np.asarray(logits, dtype=np.float64) / temperature
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    if top_p >= 1.0:
        return logp
    order = np.argsort(-logp, axis=-1, kind="stable")
    sorted_p = np.exp(np.take_along_axis(logp, order, axis=-1))
    before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly before each token
    drop_sorted = before >= top_p
    drop = np.zeros_like(drop_sorted)
    np.put_along_axis(drop, order, drop_sorted, axis=-1)
    kept = np.where(drop, -np.inf, logp)
    m = kept.max(axis=-1, keepdims=True)
    return kept - (m + np.log(np.exp(kept - m).sum(axis=-1, keepdims=True)))
