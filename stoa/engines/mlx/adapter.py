"""LoRA layers on an mlx-lm model for a LoRA run's adapter plane: the trainer's forward, PEFT's names and layout.

``use_adapter`` wraps every ``nn.Linear`` / ``nn.QuantizedLinear`` whose module path a target names (PEFT's suffix
rule) in :class:`PeftLoRALinear`: the base layer plus ``lora_A`` [r, in] and ``lora_B`` [out, r] (zero until an
adapter version is loaded), computing ``base(x) + alpha / r * lora_B(lora_A(x))`` as ``stoa.models.lora_torch``
does. The adapter's names are then the published ones (``<module>.lora_A.weight``), so ``load_adapter`` loads a
state of the ``adapter`` plane directly; a model whose module paths differ from transformers' gets no match and
its adapter versions are refused by ``stoa.weights.adapter.check_adapter`` (``tensor_mismatch``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from stoa.weights.adapter import target_matches


class PeftLoRALinear(nn.Module):
    """A linear (plain or quantized) plus a LoRA update: ``base(x) + scale * lora_B(lora_A(x))``.

    Args:
        base: the layer adapted.
        in_dims: its input features.
        out_dims: its output features.
        rank: the adapter's rank.
        scale: alpha / rank.
        dtype: the adapter's dtype (the engine's compute dtype).
    """

    def __init__(self, base: nn.Module, in_dims: int, out_dims: int, rank: int, scale: float, dtype: mx.Dtype):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(in_dims, rank, bias=False)
        self.lora_B = nn.Linear(rank, out_dims, bias=False)
        self.lora_A.weight = mx.zeros((rank, in_dims), dtype=dtype)
        self.lora_B.weight = mx.zeros((out_dims, rank), dtype=dtype)
        self.lora_scale = scale

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        delta = self.lora_B(self.lora_A(x.astype(self.lora_A.weight.dtype)))
        return y + (self.lora_scale * delta).astype(y.dtype)


def _dims(module: Any) -> tuple[int, int]:
    """(out, in) of a linear or a quantized linear."""
    if isinstance(module, nn.QuantizedLinear):
        return int(module.weight.shape[0]), int(module.scales.shape[-1]) * int(module.group_size)
    out_dims, in_dims = module.weight.shape
    return int(out_dims), int(in_dims)


def use_adapter(model: Any, rank: int, alpha: float, targets: Sequence[str], dtype: mx.Dtype) -> dict[str, tuple[int,
                                                                                                             int]]:
    """Wrap the targeted linears of ``model`` in :class:`PeftLoRALinear`; their shapes, path -> (out, in).

    Args:
        model: the mlx-lm model (its base weights loaded).
        rank: the adapter's rank.
        alpha: LoRA alpha.
        targets: module-name suffixes.
        dtype: the adapter's dtype.
    """
    found = {path: m for path, m in model.named_modules()
             if isinstance(m, nn.Linear | nn.QuantizedLinear) and target_matches(path, targets)}
    linears = {path: _dims(m) for path, m in found.items()}
    wrapped = [(path, PeftLoRALinear(m, linears[path][1], linears[path][0], rank, alpha / rank, dtype))
               for path, m in found.items()]
    model.update_modules(tree_unflatten(wrapped))
    mx.eval(model.parameters())
    return linears


def load_adapter(model: Any, named: Mapping[str, np.ndarray], dtype: mx.Dtype) -> None:
    """Load float32 adapter tensors into the layers :func:`use_adapter` added (never partially).

    Args:
        model: the model.
        named: ``<module>.lora_A.weight`` / ``.lora_B.weight`` -> float32 array.
        dtype: the compute dtype.

    Raises:
        ValueError: the names or shapes are not the model's adapters'.
    """
    params = {k: v for k, v in cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
              if k.endswith((".lora_A.weight", ".lora_B.weight"))}
    if not params or set(named) != set(params):
        raise ValueError(f"adapter tensors do not match the model's adapters ({len(named)} vs {len(params)})")
    bad = [k for k in params if tuple(named[k].shape) != tuple(params[k].shape)]
    if bad:
        raise ValueError(f"{bad[0]}: shape {named[bad[0]].shape} != model {tuple(params[bad[0]].shape)}")
    model.load_weights([(k, mx.array(np.asarray(v, np.float32)).astype(dtype)) for k, v in named.items()],
                       strict=False)
    mx.eval(model.parameters())
