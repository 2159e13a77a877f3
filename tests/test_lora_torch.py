"""The fleet trainer's torch LoRA adapters as local mode uses them: on quantized linears at chosen paths, bypassed
for the reference, merged for export, and saved under mlx-lm's names and layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from stoa.models.lora_torch import (
    LoraSpec,
    add_lora,
    from_mlx_lm,
    lora_delta,
    lora_disabled,
    peft_targets,
    to_mlx_lm,
)
from stoa.models.quant_torch import QuantLinear


def test_mlx_lm_names_transpose_the_peft_matrices_and_round_trip() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 6)).astype(np.float32), rng.standard_normal((4, 2)).astype(np.float32)
    peft = {"m.q_proj.lora_A.weight": a, "m.q_proj.lora_B.weight": b, "m.q_proj.weight": np.zeros((4, 6))}
    mlx = to_mlx_lm(peft)
    assert sorted(mlx) == ["m.q_proj.lora_a", "m.q_proj.lora_b"]  # the base weight is no adapter
    x = rng.standard_normal((3, 6)).astype(np.float32)
    np.testing.assert_allclose(x @ mlx["m.q_proj.lora_a"] @ mlx["m.q_proj.lora_b"], x @ a.T @ b.T, rtol=1e-5)
    back = from_mlx_lm(mlx)
    assert sorted(back) == ["m.q_proj.lora_A.weight", "m.q_proj.lora_B.weight"]
    assert np.array_equal(back["m.q_proj.lora_A.weight"], a) and np.array_equal(back["m.q_proj.lora_B.weight"], b)
    with pytest.raises(ValueError, match="not an mlx-lm adapter name"):
        from_mlx_lm({"m.q_proj.weight": a})


def _weight(m: nn.Module, name: str) -> torch.Tensor:
    lin = m.get_submodule(name)
    assert isinstance(lin, nn.Linear)
    return lin.weight


class _One(nn.Module):
    def __init__(self, lin: nn.Module):
        super().__init__()
        self.lin = lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.parametrize("packed", [False, True])
def test_an_adapter_on_a_quantized_linear_adds_its_update_is_bypassed_and_merges(packed: bool) -> None:
    torch.manual_seed(0)
    quant = QuantLinear(nn.Linear(64, 8), 4, 32, packed)
    model = _One(quant)
    assert add_lora(model, LoraSpec(2, 4.0), seed=1, paths=["lin"]) == ["lin"]
    with torch.no_grad():
        _weight(quant, "lora_B").normal_()
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["lin.lora_A.weight", "lin.lora_B.weight"]
    x = torch.randn(3, 64)
    with torch.no_grad():
        a, b = _weight(quant, "lora_A"), _weight(quant, "lora_B")
        base = nn.functional.linear(x, quant.dequantized(), quant.bias)
        torch.testing.assert_close(model(x), base + 2.0 * (x @ a.T @ b.T))
        with lora_disabled(model):
            torch.testing.assert_close(model(x), base)
        torch.testing.assert_close(model(x), base + 2.0 * (x @ a.T @ b.T))  # on again after the block
        merged = nn.functional.linear(x, quant.dequantized() + lora_delta(quant), quant.bias)
        torch.testing.assert_close(merged, model(x), atol=1e-5, rtol=1e-5)


def test_a_path_that_is_not_a_linear_is_refused() -> None:
    with pytest.raises(ValueError, match="not a linear"):
        add_lora(_One(nn.LayerNorm(4)), LoraSpec(2, 4.0), seed=0, paths=["lin"])


def test_peft_targets_are_leaf_names_unless_those_would_adapt_more_linears() -> None:
    model = nn.ModuleDict({"a": nn.ModuleDict({"q": nn.Linear(4, 4), "k": nn.Linear(4, 4)}),
                           "b": nn.ModuleDict({"q": nn.Linear(4, 4), "k": nn.Linear(4, 4)})})
    assert peft_targets(model, ["a.q", "b.q"]) == ("q",)
    assert peft_targets(model, ["a.q", "b.k", "a.k", "b.q"]) == ("k", "q")
    assert peft_targets(model, ["a.q", "b.k"]) == ("a.q", "b.k")  # q and k in one layer only: the full paths


class _Shared(nn.Module):
    """Two adapted linears reading one input, as q_proj and k_proj do."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.q, self.k = nn.Linear(64, 48, bias=False).to(dtype), nn.Linear(64, 16, bias=False).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x).sum(-1) + self.k(x).sum(-1)


def _chain(model: _Shared, x: torch.Tensor) -> torch.Tensor:
    """``model(x)`` with each adapter as autograd's plain chain ``out + (scale * b(a(x.to(fp32)))).to(out.dtype)``."""
    total = torch.zeros((), dtype=torch.float32)
    for lin in (model.q, model.k):
        with lora_disabled(lin):
            out = lin(x)
        a, b = _weight(lin, "lora_A"), _weight(lin, "lora_B")
        delta = nn.functional.linear(nn.functional.linear(x.to(a.dtype), a), b)
        total = total + (out + (lin.__dict__["lora_scale"] * delta).to(out.dtype)).sum(-1).float()
    return total


@pytest.mark.parametrize(("dtype", "autocast"), [(torch.bfloat16, False), (torch.float32, False),
                                                 (torch.bfloat16, True)])
def test_the_adapter_update_equals_autograds_chain_and_keeps_no_copy_of_its_input(dtype, autocast) -> None:
    torch.manual_seed(0)
    model = _Shared(dtype)
    add_lora(model, LoraSpec(4, 8.0), seed=1, paths=["q", "k"])
    with torch.no_grad():
        for lin in (model.q, model.k):
            _weight(lin, "lora_B").normal_()
    x = torch.randn(3, 5, 64, dtype=dtype, requires_grad=True)
    grads, kept = [], []
    for run in (lambda: model(x).float().sum(), lambda: _chain(model, x).sum()):
        model.zero_grad()
        x.grad = None
        saved: list[torch.Tensor] = []

        def keep(t: torch.Tensor, into: list[torch.Tensor] = saved) -> torch.Tensor:
            into.append(t)
            return t

        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
                torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            run().backward()
        assert x.grad is not None
        grads.append([x.grad.clone()] + [p.grad.clone() for p in model.parameters() if p.grad is not None])
        kept.append({(t.dtype, t.untyped_storage().data_ptr()) for t in saved if t.numel() == x.numel()})
    for ours, chain in zip(*grads, strict=True):
        assert torch.equal(ours, chain)  # bit-equal gradients of the input and of both adapters
    assert kept[0] == {(dtype, x.untyped_storage().data_ptr())}  # ours: x itself, once for both adapters
    assert len(kept[1]) > len(kept[0]) or dtype == torch.float32 and not autocast  # the chain: a copy per adapter
