"""A bf16 compute copy of the trainer's fp32 master weights (``compute_weights = "bf16_copy"``).

The forward and backward run on a second module whose parameters are the masters rounded to bf16 (buffers
copied as they are); nothing else changes: the optimizer, its AdamW state, checkpoints, exports and the published
weights read the fp32 masters. Each copy parameter hands its gradient to its master as soon as autograd has
accumulated it (a post-accumulate hook adds it to the master's fp32 ``grad`` and frees the bf16 one), so micro-batches
accumulate in fp32 as under autocast. The copy is refreshed from the masters after each optimizer step
(``refresh``) and, as a safety net, whenever a master's version counter moved (a load, another optimizer: ``sync``).

Against bf16 autocast on fp32 masters, nothing is cast per forward and every activation is bf16 (autocast keeps
the fp32 residual stream and norms beside the bf16 copies it makes); the copy itself costs 2 bytes per parameter.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from stoa.config.trainer import COMPUTE_WEIGHTS

__all__ = ["COMPUTE_WEIGHTS", "ComputeCopy"]


class ComputeCopy:
    """A bf16 module that computes for an fp32 master module, its gradients landing on the masters in fp32.

    Args:
        master: the fp32 model (parameters trained by the optimizer; left as it is).
        dtype: the copy's parameter dtype (bf16).
    """

    def __init__(self, master: torch.nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.master = master
        self.masters: list[torch.Tensor] = list(master.parameters())  # tied weights once, as the optimizer sees them
        memo: dict[int, Any] = {}
        self.copies: list[torch.Tensor] = []
        for p in self.masters:
            c = torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            memo[id(p)] = c
            self.copies.append(c)
        self.module: torch.nn.Module = copy.deepcopy(master, memo)  # same structure, tied weights stay tied
        for c, p in zip(self.copies, self.masters, strict=True):
            if c.requires_grad:
                c.register_post_accumulate_grad_hook(_to_master(p))
        self.versions = self._versions()

    def _versions(self) -> list[int]:
        return [p._version for p in self.masters]

    def refresh(self) -> None:
        """Round every master into its copy (after an optimizer step)."""
        with torch.no_grad():
            for c, p in zip(self.copies, self.masters, strict=True):
                c.copy_(p)
        self.versions = self._versions()

    def sync(self) -> torch.nn.Module:
        """The compute module, refreshed first if a master changed since the last refresh (an optimizer step, a
        load) and in the masters' train/eval mode."""
        if self._versions() != self.versions:
            self.refresh()
        if self.module.training != self.master.training:
            self.module.train(self.master.training)
        return self.module


def _to_master(master: torch.Tensor):
    """A post-accumulate-grad hook that moves a copy's bf16 gradient onto ``master`` in fp32 and frees it."""

    def hook(c: torch.Tensor) -> None:
        g = c.grad
        if g is None:
            return
        if master.grad is None:
            master.grad = g.to(master.dtype)
        else:
            master.grad.add_(g)
        c.grad = None

    return hook
