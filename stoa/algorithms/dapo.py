"""DAPO (arXiv 2503.14476): clip-higher, dynamic sampling, token-level loss, overlong reward shaping."""

# Departs from the paper: dynamic sampling is a filter (keep_groups) — the trainer drops zero-variance
# groups rather than sampling more until the batch is full; overlong shaping is off until
# overlong_buffer is set (the paper used 4096 of 20480); overlong filtering is not implemented; the
# dual-clip bound and the DPPO gate are added; the KL term is off in the preset as in the paper.

from __future__ import annotations

import numpy as np

from stoa.algorithms.advantages import nonzero_variance
from stoa.algorithms.bases import TokenPolicyAlgorithm


class DAPO(TokenPolicyAlgorithm):
    """Decoupled clip and dynamic sampling policy optimisation, token-mean over the whole batch."""

    name = "dapo"
    reduction = "token_mean"

    def keep_groups(self, rewards: np.ndarray) -> np.ndarray:
        """bool [G]: groups whose raw rewards are not all equal (all-correct/all-wrong groups go).

        Args:
            rewards: [G, n] raw rewards.
        """
        return nonzero_variance(rewards)
