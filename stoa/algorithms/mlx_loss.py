"""The MLX backend of the loss math: the Ops shim over mx arrays and a token-logprob helper."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np


def token_logprobs(logits: mx.array, targets: mx.array, temperature: float = 1.0) -> mx.array:
    """Logprobs [B, T] of ``targets`` under ``log_softmax(logits / temperature)`` in float32.

    Args:
        logits: [B, T, V] (any float dtype; upcast to float32).
        targets: [B, T] token ids.
        temperature: the workers' sampling temperature.
    """
    z = logits.astype(mx.float32) / temperature
    logp = z - mx.logsumexp(z, axis=-1, keepdims=True)
    return mx.take_along_axis(logp, targets.astype(mx.int32)[..., None], axis=-1)[..., 0]


def token_hits(logits: mx.array, targets: mx.array) -> mx.array:
    """0/1 float32 [B, T]: the argmax of ``logits`` [B, T, V] equals ``targets`` [B, T] (ECHO's accuracy).

    Args:
        logits: [B, T, V] logits (temperature does not move the argmax).
        targets: [B, T] token ids.
    """
    hit = mx.argmax(mx.stop_gradient(logits), axis=-1) == targets.astype(mx.int32)
    return hit.astype(mx.float32)


class MlxOps:
    """``stoa.algorithms.ops.Ops`` for mx arrays.

    ``to_floats`` evaluates, so losses that report diagnostics cannot run under ``mx.compile``;
    they do run under ``mx.value_and_grad`` (the diagnostics ride along as the auxiliary output).
    """

    name = "mlx"

    def f32(self, x: Any) -> mx.array:
        return x.astype(mx.float32) if isinstance(x, mx.array) else mx.array(x, dtype=mx.float32)

    def exp(self, x: mx.array) -> mx.array:
        return mx.exp(x)

    def log(self, x: mx.array) -> mx.array:
        return mx.log(x)

    def expm1(self, x: mx.array) -> mx.array:
        return mx.expm1(x)

    def minimum(self, a: mx.array, b: mx.array) -> mx.array:
        return mx.minimum(a, b)

    def maximum(self, a: mx.array, b: mx.array) -> mx.array:
        return mx.maximum(a, b)

    def clip(self, x: mx.array, lo: float | None, hi: float | None) -> mx.array:
        return mx.clip(x, lo, hi)

    def where(self, cond: mx.array, a: Any, b: Any) -> mx.array:
        return mx.where(cond, a, b)

    def stop_gradient(self, x: mx.array) -> mx.array:
        return mx.stop_gradient(x)

    def sum(self, x: mx.array, axis: int | None = None) -> mx.array:
        return mx.sum(x) if axis is None else mx.sum(x, axis=axis)

    def max(self, x: mx.array) -> mx.array:
        return mx.max(x)

    def to_floats(self, xs: Sequence[Any]) -> list[float]:
        if not xs:
            return []
        stacked = mx.stack([mx.stop_gradient(x).astype(mx.float32).reshape(()) for x in xs])
        return [float(v) for v in np.array(stacked).tolist()]

    def to_numpy(self, x: mx.array) -> np.ndarray:
        return np.array(mx.stop_gradient(x).astype(mx.float32))

    def token_logprobs(self, logits: mx.array, targets: mx.array, temperature: float) -> mx.array:
        return token_logprobs(logits, targets, temperature)

    def token_hits(self, logits: mx.array, targets: mx.array) -> mx.array:
        return token_hits(logits, targets)


OPS = MlxOps()
