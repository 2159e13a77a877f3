"""GiGPO (Feng et al. 2025, arXiv 2505.10978, "Group-in-Group Policy Optimization for LLM Agent Training")."""

# Follows verl-agent's implementation: the episode advantage is GRPO's (group-normalised final reward); each
# turn's discounted return gamma^(K-1-t) * R is normalised within its anchor group (the turns of one prompt
# group that start from the same state key), singletons get 0; the action tokens of turn t get
# A_episode + omega * A_step(t). Departs from it: the std is the population std + 1e-6 like stoa's GRPO
# (verl-agent uses torch's unbiased std), and adv_std_norm switches both normalisations (verl-agent's
# mean_norm / mean_std_norm modes); a whole episode is one training row (verl-agent trains each turn as its
# own sample), reduced by GRPO's seq-mean-token-mean; anchors are exact state keys from the environment
# (``Observation.state``), and the empty key never forms a group.

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stoa.algorithms.advantages import gigpo_turn_advantages
from stoa.algorithms.grpo import GRPO


class GiGPO(GRPO):
    """GRPO's loss with per-token advantages: episode advantage plus omega times the anchor-state step one."""

    name = "gigpo"

    def turn_advantages(self, rewards: np.ndarray, lengths: np.ndarray,
                        states: Sequence[Sequence[Sequence[str]]]) -> list[list[np.ndarray]] | None:
        """omega * step advantage of each turn ([G][n] arrays [K]); None when no trajectory has anchor states
        (single-turn batches: exactly GRPO).

        Args:
            rewards: [G, n] raw rewards (shaped like the episode advantage's).
            lengths: [G, n] action-token counts.
            states: [G][n] anchor keys of each trajectory's turns (``Trajectory.states``).
        """
        if not any(len(keys) for group in states for keys in group):
            return None
        c = self.cfg
        return gigpo_turn_advantages(self.shape_rewards(rewards, lengths), states, c.gigpo_gamma, c.gigpo_omega,
                                     c.adv_std_norm)
