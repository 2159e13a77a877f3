"""Pieces of the MLX local backend that need no model: typed tree flattening, per-layer checkpointing, and
loss ops whose diagnostics stay lazy inside ``value_and_grad``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten as _tree_flatten

from stoa.algorithms.mlx_loss import MlxOps

__all__ = ["DeferredDiagnostics", "enable_layer_checkpointing", "tree_flatten"]


def tree_flatten(tree: Any) -> list[tuple[str, Any]]:
    """``mlx.utils.tree_flatten`` as a list of (name, leaf) pairs (typed for the checker).

    Args:
        tree: a parameter, gradient or optimizer-state tree.
    """
    flat: Any = _tree_flatten(tree)
    return list(flat)


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
