"""Leaner activations for the trainer's forward: cheap elementwise work recomputed in backward instead of kept.

Two kinds of module keep more for backward than their output is worth:

- RMSNorm (HF's, every family): it upcasts its input to fp32, so it keeps an fp32 copy of the input and the
  normalised fp32 values (6 bytes per value in bf16, 8 in fp32) where its input alone (2 or 4) suffices to redo it.
  Each norm runs under activation checkpointing: backward recomputes it from the kept input.
- A SwiGLU MLP (``down(act(gate(x)) * up(x))``): it keeps the gate, ``act(gate)``, the up projection and their
  product. ``act(gate) * up`` runs under checkpointing, so ``act(gate)`` is recomputed instead of kept (one value
  per MLP unit less). Only classes whose ``forward`` is exactly that line are changed.

Recomputing is bit-exact (the same deterministic ops on the same inputs), so gradients do not change (tested).
On SmolLM2-135M at 16 rows of 112 tokens it keeps ~0.4 GB less in bf16 (about 1/4 of a micro-batch's activations).
Applied to the module that trains (the master model, or the bf16 compute copy), never with gradient checkpointing
(whole blocks are recomputed then).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["SWIGLU_LINE", "lean_activations"]

SWIGLU_LINE = "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"
"""The expression an MLP's ``forward`` must return for it to be made lean (Llama, Qwen2/3, Mistral...)."""


def _recomputed(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, its intermediates recomputed in backward (checkpointing) when gradients are on."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)


_SWIGLU: dict[type, bool] = {}


def _is_swiglu(cls: type) -> bool:
    """Whether ``cls.forward`` is exactly ``return down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (cached)."""
    if cls not in _SWIGLU:
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError, AttributeError):
            source = ""
        body = [ln.strip() for ln in source.splitlines()[1:] if ln.strip() and not ln.strip().startswith("#")]
        _SWIGLU[cls] = body in ([f"return {SWIGLU_LINE}"], [f"down_proj = {SWIGLU_LINE}", "return down_proj"])
    return _SWIGLU[cls]


def _lean_swiglu(mlp: Any) -> None:
    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return mlp.act_fn(gate) * up

    def forward(x: torch.Tensor) -> torch.Tensor:
        return mlp.down_proj(_recomputed(glu, mlp.gate_proj(x), mlp.up_proj(x)))

    mlp.forward = forward


def _lean_norm(norm: torch.nn.Module) -> None:
    plain = norm.forward
    norm.forward = functools.partial(_recomputed, plain)


def lean_activations(model: torch.nn.Module) -> int:
    """Make ``model``'s RMSNorms and SwiGLU MLPs recompute their elementwise intermediates in backward; returns
    how many modules changed.

    Args:
        model: the module that computes the trained forward (its parameters keep their gradients as before).
    """
    changed = 0
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            _lean_norm(m)
        elif _is_swiglu(type(m)) and all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            _lean_swiglu(m)
        else:
            continue
        changed += 1
    return changed
