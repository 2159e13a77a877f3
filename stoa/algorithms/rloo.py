"""RLOO (arXiv 2402.14740): leave-one-out baseline advantages."""

# Departs from the paper: the paper's sequence-level REINFORCE is replaced by the clipped token
# surrogate (with dual-clip, DPPO gate, KL) and a token-mean reduction, so the same off-policy
# safeguards apply to records sampled by stale workers; only the advantage estimator is RLOO's.

from __future__ import annotations

import numpy as np

from stoa.algorithms.advantages import leave_one_out_advantages
from stoa.algorithms.bases import TokenPolicyAlgorithm


class RLOO(TokenPolicyAlgorithm):
    """A_i = r_i - mean of the other rewards of the group; clipped token surrogate, token mean."""

    name = "rloo"
    reduction = "token_mean"

    def advantages(self, rewards: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Leave-one-out advantages [G, n] float32 of the shaped rewards.

        Args:
            rewards: [G, n] raw rewards.
            lengths: [G, n] completion lengths in tokens.
        """
        return leave_one_out_advantages(self.shape_rewards(rewards, lengths))
