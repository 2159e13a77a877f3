"""The tiny array-namespace shim the shared loss math is written against (torch or MLX behind it)."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

_BACKEND_MODULES = {"torch": "stoa.algorithms.torch_loss", "mlx": "stoa.algorithms.mlx_loss"}


class Ops(Protocol):
    """Element-wise and reduction primitives; ``x`` is a backend array, scalars are Python floats."""

    name: str

    def f32(self, x: Any) -> Any:
        """Cast to float32 (bool masks become 0/1), keeping the gradient path."""
        ...

    def exp(self, x: Any) -> Any: ...

    def log(self, x: Any) -> Any: ...

    def expm1(self, x: Any) -> Any: ...

    def minimum(self, a: Any, b: Any) -> Any: ...

    def maximum(self, a: Any, b: Any) -> Any: ...

    def clip(self, x: Any, lo: float | None, hi: float | None) -> Any:
        """Clip to [lo, hi] with scalar bounds; None leaves that side open."""
        ...

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        """Element-wise select; ``a`` or ``b`` may be a Python float."""
        ...

    def stop_gradient(self, x: Any) -> Any: ...

    def sum(self, x: Any, axis: int | None = None) -> Any: ...

    def max(self, x: Any) -> Any:
        """Maximum over all elements (0-d)."""
        ...

    def to_floats(self, xs: Sequence[Any]) -> list[float]:
        """Python floats of several 0-d arrays with one device round trip."""
        ...

    def to_numpy(self, x: Any) -> np.ndarray:
        """A detached numpy copy."""
        ...

    def token_logprobs(self, logits: Any, targets: Any, temperature: float) -> Any:
        """log_softmax(logits [B, T, V] / temperature) gathered at ``targets`` [B, T] (float32)."""
        ...

    def token_hits(self, logits: Any, targets: Any) -> Any:
        """0/1 float32 [B, T]: argmax of ``logits`` [B, T, V] equals ``targets`` [B, T] (no gradient)."""
        ...


def load_ops(backend: str) -> Ops:
    """The Ops of a backend, importing torch or mlx only now.

    Args:
        backend: 'torch' or 'mlx'.
    """
    if backend not in _BACKEND_MODULES:
        raise ValueError(f"backend: unknown backend {backend!r}; known: torch, mlx")
    module = importlib.import_module(_BACKEND_MODULES[backend])
    return module.OPS
