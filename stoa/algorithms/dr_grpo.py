"""Dr.GRPO (arXiv 2503.20783): GRPO without std normalisation or length normalisation."""

# Departs from the paper: the constant normaliser is the run's max_tokens (the sampler's cap) times
# the number of sequences in the whole step batch; the dual-clip bound and the DPPO gate are added
# (as in GRPO); the ratio's "old" policy is the worker-recorded behaviour logprob.

from __future__ import annotations

from stoa.algorithms.bases import TokenPolicyAlgorithm


class DrGRPO(TokenPolicyAlgorithm):
    """Advantages r - mean(r); loss = sum over a sequence's tokens / max_tokens, mean over sequences."""

    name = "dr_grpo"
    reduction = "seq_mean_token_sum_norm"
