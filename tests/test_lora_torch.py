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
