"""Comparing recorded logprobs with a torch recompute when top-p can put a token on the nucleus edge.

Two engines compute fp32 logits that differ by ~1e-6. The nucleus keeps a token while the mass of the
tokens before it is below ``top_p``; when that mass lies within ``EDGE`` of ``top_p``, one engine can keep the
token and the other drop it. Both are honest: the normaliser then differs by that token's probability
(~1e-3 on the tiny model), which is far above the agreement tolerance. Such positions are a property of
top-p sampling, not an engine error, so a recorded logprob may match the recompute with the threshold moved by
``EDGE`` either way. A broken engine (top-p ignored, a wrong temperature, another distribution) is off at
nearly every position, and ``edge_share`` bounds how many positions may use the moved threshold.
"""

from __future__ import annotations

import numpy as np

EDGE = 1e-4
"""How far from ``top_p`` a cumulative mass counts as on the edge (fp32 logits of two engines differ ~1e-6)."""
MAX_EDGE_SHARE = 0.05
"""At most this share of the compared positions may need the moved threshold."""


def edge_aware_gaps(logits, tokens: list[int], recorded: np.ndarray, temperature: float, top_p: float,
                    tol: float) -> tuple[np.ndarray, int]:
    """Per-position |recorded - recompute| with the nucleus-edge allowance, and how many positions used it.

    Args:
        logits: torch [N, V] float32 logits at the N positions that sampled ``tokens``.
        tokens: the N sampled token ids.
        recorded: the N logprobs the engine recorded.
        temperature: the sampling temperature.
        top_p: the nucleus mass.
        tol: the agreement tolerance; a position uses the allowance when only the moved threshold is within it.
    """
    import torch

    from stoa.engines.torch import sampling_logprobs_torch

    index = torch.tensor(tokens)[:, None]

    def ref(p: float) -> np.ndarray:
        return sampling_logprobs_torch(logits, temperature, min(p, 1.0)).gather(-1, index)[:, 0].double().numpy()

    exact = np.abs(recorded - ref(top_p))
    if top_p >= 1.0:
        return exact, 0
    moved = np.minimum(np.abs(recorded - ref(top_p - EDGE)), np.abs(recorded - ref(top_p + EDGE)))
    used = (exact > tol) & (moved <= tol)
    return np.where(used, moved, exact), int(used.sum())
