"""Lean activations (``stoa.trainer.lean``): the norms and SwiGLU MLPs recompute their elementwise intermediates in
backward, which keeps less memory for backward and leaves every gradient bit-exact."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from stoa.trainer import lean as lean_mod
from stoa.trainer.policy import Policy
from tests.test_trainer_precision import packed_rows

CPU = torch.device("cpu")


def grads(tiny_dir, lean: bool, **kw) -> tuple[torch.Tensor, list[torch.Tensor]]:
    _, batch = packed_rows()
    pol = Policy(tiny_dir, CPU, lean=lean, **kw)
    lp = pol.logprobs(batch)
    (lp.sum() * 0.5).backward()
    return lp.detach(), [p.grad.clone() for p in pol.model.parameters()]


@pytest.mark.parametrize("kw", [{}, {"compute_dtype": torch.bfloat16, "compute_weights": "bf16_copy"}],
                         ids=["fp32", "bf16_copy"])
def test_lean_activations_leave_logprobs_and_gradients_bit_exact(tiny_dir, kw):
    lp, g = grads(tiny_dir, False, **kw)
    lean_lp, lean_g = grads(tiny_dir, True, **kw)
    assert torch.equal(lp, lean_lp)
    assert all(torch.equal(a, b) for a, b in zip(g, lean_g, strict=True))


def kept_bytes(pol: Policy, monkeypatch) -> int:
    """Bytes of the distinct tensors one forward keeps for backward: what autograd saves, plus the inputs that
    checkpointed parts keep to recompute from."""
    kept: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad or t.grad_fn is not None or t.numel() > 1:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    real = lean_mod._recomputed

    def recomputed(fn, *args, **kwargs):
        for a in args:
            keep(a)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(lean_mod, "_recomputed", recomputed)
    params = {p.untyped_storage().data_ptr() for p in pol.model.parameters()}
    if pol.copy is not None:
        params |= {p.untyped_storage().data_ptr() for p in pol.copy.copies}
    _, batch = packed_rows(width=32)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        pol.logprobs(batch)
    return sum(n for ptr, n in kept.items() if ptr not in params)


@pytest.mark.parametrize("kw", [{}, {"compute_dtype": torch.bfloat16, "compute_weights": "bf16_copy"}],
                         ids=["fp32", "bf16_copy"])
def test_lean_activations_keep_a_tenth_less_for_backward_on_the_tiny_model(tiny_dir, monkeypatch, kw):
    plain = kept_bytes(Policy(tiny_dir, CPU, lean=False, **kw), monkeypatch)
    lean = kept_bytes(Policy(tiny_dir, CPU, **kw), monkeypatch)
    assert lean < 0.9 * plain, (lean, plain)


def test_lean_changes_every_norm_and_swiglu_mlp_of_the_module_that_trains(tiny_dir):
    pol = Policy(tiny_dir, CPU, compute_dtype=torch.bfloat16, compute_weights="bf16_copy")
    assert pol.lean and pol.copy is not None
    module = pol.copy.module
    norms = [m for m in module.modules() if type(m).__name__.endswith("RMSNorm")]
    mlps = [m for m in module.modules() if type(m).__name__.endswith("MLP")]
    assert norms and mlps and all("forward" in vars(m) for m in norms + mlps)
    assert not any("forward" in vars(m) for m in pol.model.modules())  # the masters' modules stay as loaded
    assert not Policy(tiny_dir, CPU, trainable=False).lean
    assert not Policy(tiny_dir, CPU, gradient_checkpointing=True).lean


def test_only_an_exact_swiglu_forward_is_changed():
    class Swiglu(torch.nn.Module):
        def forward(self: Any, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    class Scaled(torch.nn.Module):
        def forward(self: Any, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * 2

    assert lean_mod._is_swiglu(Swiglu) and not lean_mod._is_swiglu(Scaled)
