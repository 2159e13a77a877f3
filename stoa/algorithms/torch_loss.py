"""The torch backend of the loss math: the Ops shim over torch tensors, a token-logprob helper, and the clipped
optimizer step every torch trainer takes (``clip_and_step``: the fleet trainer's step and cold start, local mode's
torch backend)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Logprobs [B, T] of ``targets`` under ``log_softmax(logits / temperature)`` in float32.

    Args:
        logits: [B, T, V] (any float dtype; upcast to float32).
        targets: [B, T] token ids.
        temperature: the workers' sampling temperature.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return torch.gather(logp, -1, targets.long().unsqueeze(-1)).squeeze(-1)


def clip_and_step(params: Sequence[torch.Tensor], opt: torch.optim.Optimizer, grad_clip: float) -> float:
    """Clip the accumulated gradients to a global norm of ``grad_clip`` (0: no clip), step, clear them (to None);
    the pre-clip global norm (a sharded model's norm, a DTensor, made whole).

    Args:
        params: the parameters the optimizer steps.
        opt: the optimizer.
        grad_clip: the largest global gradient norm (0: no clip).
    """
    norm = torch.nn.utils.clip_grad_norm_(list(params), grad_clip if grad_clip > 0 else float("inf"))
    opt.step()
    opt.zero_grad(set_to_none=True)
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


def token_hits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """0/1 float32 [B, T]: the argmax of ``logits`` [B, T, V] equals ``targets`` [B, T] (ECHO's accuracy).

    Args:
        logits: [B, T, V] logits (temperature does not move the argmax).
        targets: [B, T] token ids.
    """
    with torch.no_grad():
        return (logits.argmax(dim=-1) == targets.long()).float()


class TorchOps:
    """``stoa.algorithms.ops.Ops`` for torch tensors."""

    name = "torch"

    def f32(self, x: Any) -> torch.Tensor:
        return x.float() if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.float32)

    def exp(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)

    def log(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)

    def expm1(self, x: torch.Tensor) -> torch.Tensor:
        return torch.expm1(x)

    def minimum(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.minimum(a, b)

    def maximum(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.maximum(a, b)

    def clip(self, x: torch.Tensor, lo: float | None, hi: float | None) -> torch.Tensor:
        return torch.clamp(x, min=lo, max=hi)

    def where(self, cond: torch.Tensor, a: Any, b: Any) -> torch.Tensor:
        return torch.where(cond, a, b)

    def stop_gradient(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    def sum(self, x: torch.Tensor, axis: int | None = None) -> torch.Tensor:
        return x.sum() if axis is None else x.sum(dim=axis)

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return x.max()

    def to_floats(self, xs: Sequence[Any]) -> list[float]:
        if not xs:
            return []
        return [float(v) for v in torch.stack([x.detach().float().reshape(()) for x in xs]).cpu().tolist()]

    def to_numpy(self, x: torch.Tensor) -> np.ndarray:
        return x.detach().float().cpu().numpy()

    def token_logprobs(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        return token_logprobs(logits, targets, temperature)

    def token_hits(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_hits(logits, targets)


OPS = TorchOps()
