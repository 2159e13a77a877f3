"""The trainer's rounding probe: how far bf16 rounding alone moves this model's logprobs, measured by the trainer on its
own weights, the floor of the sequential test's calibrated drift (``stoa.trainer.fleet``).

An honest worker's records differ from the trainer's recompute by its engine's arithmetic: a worker that samples in
bf16 against an fp32 trainer (or in fp32 against a bf16 one) carries bf16's rounding. The fleet's median level is the
majority's, so a fleet of mostly fp32 workers would set a drift under what an honest bf16 minority scores. The probe
scores one group of a step as a record is scored (``record_score`` of ``exp|a - b| - 1`` over its tokens), with ``a``
the fp32 forward and ``b`` the bf16-autocast forward of the policy's master weights, its prompt run once.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from stoa.algorithms.batch import Batch, group_indices
from stoa.engines.torch_scoring import group_score
from stoa.trainer.policy import Policy
from stoa.trainer.quarantine import disagreement_values
from stoa.trainer.sequential import record_score


def probes_rounding(policy: Policy) -> bool:
    """Whether the policy can probe: one rank, float32 master weights (a LoRA policy's frozen base is stored in the
    compute dtype, which an fp32 forward cannot take, and its residuals are measured in docs/verification.md)."""
    return not policy.dist.sharded and policy.lora is None


def rounding_probe(policy: Policy, batch: Batch) -> float | None:
    """The record score of the batch's first group between the policy's fp32 and bf16-autocast logprobs (no
    gradient, the master weights); None where the policy cannot probe (``probes_rounding``) or the group has no
    action token.

    Args:
        policy: the trainer's policy (before this step's update).
        batch: the step's batch.
    """
    if not probes_rounding(policy) or not len(batch):
        return None
    idx = group_indices(batch)[0]
    mask = batch.mask[idx]
    if not mask.any():
        return None
    rows = [batch.rows[int(i)] for i in idx]
    at = functools.partial(group_score, prompt=rows[0].prompt, completions=[r.tokens for r in rows],
                           t_max=batch.width, mask=mask, device=policy.device, temperature=policy.temperature)
    with torch.no_grad():
        fp32 = policy.root(functools.partial(at, autocast=None)).logp.float().cpu().numpy()
        bf16 = policy.root(functools.partial(at, autocast=torch.bfloat16)).logp.float().cpu().numpy()
    return record_score(disagreement_values(fp32, bf16)[mask > 0], math.inf)


def finite(score: float | None) -> list[float]:
    """``[score]`` for a finite probe, else ``[]`` (what ``StepMetrics.rounding`` holds)."""
    return [score] if score is not None and np.isfinite(score) else []
