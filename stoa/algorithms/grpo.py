"""GRPO (arXiv 2402.03300): group mean/std advantages, clipped token surrogate, per-sequence token mean."""

# Departs from the paper: the ratio's "old" policy is the worker-recorded behaviour logprob (no trainer
# recompute), so it also absorbs staleness and engine mismatch; std is the population std + 1e-6; the
# dual-clip bound and the DPPO trust-region gate are added (both on by default, off with
# dual_clip_c=None / gate='none'); the KL term uses k3 with a small beta as in the paper.

from __future__ import annotations

from stoa.algorithms.bases import TokenPolicyAlgorithm


class GRPO(TokenPolicyAlgorithm):
    """Group Relative Policy Optimization with the paper's seq-mean-token-mean reduction."""

    name = "grpo"
    reduction = "seq_mean_token_mean"
