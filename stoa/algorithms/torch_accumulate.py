"""The micro-batch accumulation every torch trainer runs: the fleet trainer's ``train_step`` and local mode's torch
backend call the same loop (issue 28: local mode becomes the trainer plus an in-process worker).

Each caller brings its forward (the trainer's ``Policy`` with a shared-prefix or packed batch, its reference; local
mode's quantized base with adapters) and, optionally, an observer of each micro-batch's logprobs (the trainer's
recompute check; local mode's old-policy fill). The loop builds the algorithm's inputs under the whole batch's
normaliser, runs the loss and its backward, and sums the diagnostics, so the gradients of a step do not depend on
which process took it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from stoa.algorithms.base import Algorithm
from stoa.algorithms.batch import Batch
from stoa.algorithms.inputs import EchoStep, micro_inputs


class MicroForward(NamedTuple):
    """What a caller's forward returns for one micro-batch."""

    logp: torch.Tensor
    """[b, T] current-policy logprobs at the batch's width, with gradient."""
    hits: torch.Tensor | None
    """[b, T] argmax hits (only when ``EchoStep.hits``)."""
    ref_logp: torch.Tensor | None
    """[b, T] reference logprobs of the same rows; None: the batch's ``ref_logp`` rows (or no reference)."""


class Accumulated(NamedTuple):
    """What ``accumulate`` leaves besides the gradients."""

    parts: list[dict[str, float]]
    """Each micro-batch's loss diagnostics (``combine_metrics`` joins them)."""
    loss: float
    """The sum of the micro-batches' losses (the whole-batch loss: they share its normaliser)."""
    trained: list[np.ndarray]
    """Per micro-batch, the rows whose loss went into the gradients (all of them unless the observer kept fewer)."""


Observer = Callable[[np.ndarray, torch.Tensor], "np.ndarray | None"]
"""Sees a micro-batch's rows and their logprobs before the loss; returns [b] 0/1 rows to keep, or None for all."""


def accumulate(algo: Algorithm, batch: Batch, micro: Sequence[np.ndarray],
               forward: Callable[[np.ndarray], MicroForward], *, to: Callable[[np.ndarray], torch.Tensor],
               echo: EchoStep, observe: Observer | None = None, lags: bool = True, sign: float = 1.0
               ) -> Accumulated:
    """Forward and backward every micro-batch under the whole batch's normaliser; the gradients add up.

    The old policy is ``batch.old_logp`` (a trainer's: the workers' recorded logprobs; local mode's: a separate
    forward) or, when the batch has none, each forward's own logprobs detached (on-policy, ratio 1).

    Args:
        algo: a torch ``Algorithm``.
        batch: the step's batch.
        micro: row indices per micro-batch.
        forward: the caller's forward of one micro-batch's rows.
        to: numpy -> tensor on the model's device.
        echo: the step's echo settings (``stoa.algorithms.inputs.echo_step``).
        observe: called with each micro-batch's rows and logprobs before its loss (rows it returns 0 for get empty
            masks: no loss).
        lags: pass the rows' version lags to the loss (its per-lag diagnostics).
        sign: -1 subtracts the rows' loss from the gradients again (the trainer's undo of rows that trained
            before their group was rejected); ``Accumulated.loss`` carries the sign.
    """
    parts: list[dict[str, float]] = []
    total = 0.0
    trained: list[np.ndarray] = []
    for idx in micro:
        fw = forward(idx)
        keep = observe(idx, fw.logp) if observe is not None else None
        loss, diag = algo.loss(micro_inputs(batch, idx, fw.logp, to=to, stop=torch.Tensor.detach,
                                            ref_logp=fw.ref_logp, echo=echo.echo, echo_alpha=echo.alpha,
                                            hits=fw.hits if echo.hits else None, keep=keep, lags=lags))
        (loss if sign == 1.0 else sign * loss).backward()
        total += sign * float(loss.detach())
        parts.append(diag)
        trained.append(idx if keep is None else idx[keep > 0])
    return Accumulated(parts, total, trained)
