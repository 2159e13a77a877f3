"""Pieces of the MLX local backend that need no model: typed tree flattening, per-layer checkpointing, and
loss ops whose diagnostics stay lazy inside ``value_and_grad``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten as _tree_flatten

from stoa.algorithms.mlx_loss import MlxOps
from stoa.engines.mlx.quantized import use_blas_for_quantized
from stoa.local.targets import is_router

__all__ = ["DeferredDiagnostics", "add_lora", "enable_layer_checkpointing", "quantize_blocks", "tree_flatten"]


def tree_flatten(tree: Any) -> list[tuple[str, Any]]:
    """``mlx.utils.tree_flatten`` as a list of (name, leaf) pairs (typed for the checker).

    Args:
        tree: a parameter, gradient or optimizer-state tree.
    """
    flat: Any = _tree_flatten(tree)
    return list(flat)


def quantize_blocks(model: nn.Module, layers: Sequence[nn.Module], bits: int, group_size: int) -> int:
    """Quantize the decoder blocks' linears and expert banks (``SwitchLinear``), not routers; returns how many.

    Routers stay float so both backends route alike (torch's routers are not ``nn.Linear``); a layer whose
    input width is not a multiple of ``group_size`` stays float, as on torch. Embeddings and the head stay float.

    Args:
        model: the mlx-lm model.
        layers: its decoder layers.
        bits: 4 or 8.
        group_size: quantization group along the input dimension.
    """
    from mlx_lm.models.switch_layers import SwitchLinear

    chosen = {id(m) for layer in layers for p, m in layer.named_modules()
              if isinstance(m, nn.Linear | SwitchLinear) and not is_router(p) and m.weight.shape[-1] % group_size == 0}
    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=lambda _p, m: id(m) in chosen)
    use_blas_for_quantized(model)  # CPU only: MLX's CPU quantized kernel is ~30x slower than BLAS
    return len(chosen)


def add_lora(layers: Sequence[nn.Module], targets: Sequence[Sequence[str]], rank: int, scale: float) -> None:
    """Wrap each layer's own target linears in mlx-lm ``LoRALinear`` (per layer: ``linear_to_lora_layers``
    takes one key set for every layer, which adapts a hybrid stack's conv-block names in its attention blocks).

    Args:
        layers: the decoder layers.
        targets: per layer, the paths to adapt (``choose_targets``).
        rank: LoRA rank.
        scale: alpha / rank.
    """
    from mlx.utils import tree_unflatten
    from mlx_lm.tuner.lora import LoRALinear

    for layer, paths in zip(layers, targets, strict=True):
        modules = dict(layer.named_modules())
        wrapped = [(p, LoRALinear.from_base(modules[p], r=rank, scale=scale, dropout=0.0)) for p in paths]
        layer.update_modules(tree_unflatten(wrapped))


def enable_layer_checkpointing(layers: Sequence[nn.Module]) -> None:
    """Make each layer's ``__call__`` an ``mx.checkpoint`` while its ``_stoa_checkpoint`` flag is set.

    The class is patched once (like ``mlx_lm.tuner.trainer.grad_checkpoint``), but the wrapper only
    checkpoints instances that carry the flag, so other models in the process are unaffected and rollout
    (flag cleared) runs the plain layer.

    Args:
        layers: the decoder layers.
    """
    for cls in {type(layer) for layer in layers}:
        if cls.__dict__.get("_stoa_checkpoint_patched", False):
            continue
        original = cls.__call__

        def call(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            if not getattr(self, "_stoa_checkpoint", False):
                return _original(self, *args, **kwargs)

            def inner(params: Any, *a: Any, **k: Any) -> Any:
                self.update(params)
                return _original(self, *a, **k)

            return mx.checkpoint(inner)(self.trainable_parameters(), *args, **kwargs)

        cls.__call__ = call
        setattr(cls, "_stoa_checkpoint_patched", True)  # noqa: B010 - a class flag, not a Module leaf


class DeferredDiagnostics(MlxOps):
    """MLX ops whose ``to_floats`` does not evaluate: the loss inside ``value_and_grad`` stays one lazy graph.

    ``Algorithm.loss`` reports diagnostics through ``to_floats``, which evaluates; inside ``value_and_grad``
    that materialises the whole forward before the backward is even built, and every intermediate stays
    alive (measured: twice the peak memory on SmolLM2). The gradient pass uses an algorithm built on these
    ops (zeros for the diagnostics), and the real diagnostics are computed afterwards from the evaluated
    logprobs, with no model forward.
    """

    def to_floats(self, xs: Sequence[Any]) -> list[float]:
        return [0.0] * len(xs)
