"""The clip tie: a ratio exactly on a bound keeps its gradient, the same on every backend and version.

``clipped_surrogate`` picks its regime by strict inequalities (A > 0 and r > 1 + eps_high, A < 0 and
r < 1 - eps_low, A < 0 and r > c). With ``maximum``/``minimum`` a tie splits the gradient in a way
that changed between torch releases (half the expected gradient on 2.14.1); these cases sit on the
bounds in float32 and one ulp past them.
"""

from __future__ import annotations

import numpy as np
import pytest

from stoa.algorithms.core import clipped_surrogate

from .conftest import BACKENDS

F32 = np.float32
EPS_LOW, EPS_HIGH, DUAL_C = 0.2, 0.2, 3.0


def _past(x: float, direction: float) -> float:
    return float(np.nextafter(F32(x), F32(direction)))


# (ratio, advantage, expected loss, expected d loss / d ratio)
EDGE_CASES = [
    (1.2, 1.0, -1.2, -1.0),  # A > 0 on the upper bound: free
    (_past(1.2, 2.0), 1.0, -1.2, 0.0),  # one ulp above: clipped
    (0.8, -1.0, 0.8, 1.0),  # A < 0 on the lower bound: free
    (_past(0.8, 0.0), -1.0, 0.8, 0.0),  # one ulp below: clipped
    (3.0, -1.0, 3.0, 1.0),  # A < 0 on the dual-clip bound: free
    (_past(3.0, 4.0), -1.0, 3.0, 0.0),  # one ulp above: dual-clipped
    (1.2, -1.0, 1.2, 1.0),  # A < 0 at the upper bound: the upper clip never binds for A < 0
    (0.8, 1.0, -0.8, -1.0),  # A > 0 at the lower bound: the lower clip never binds for A > 0
]


def _run(backend: str, ratio: np.ndarray, adv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if backend == "torch":
        import torch

        from stoa.algorithms.torch_loss import OPS

        r = torch.tensor(ratio, requires_grad=True)
        loss = clipped_surrogate(OPS, r, torch.tensor(adv), EPS_LOW, EPS_HIGH, DUAL_C)
        loss.sum().backward()
        assert r.grad is not None
        return loss.detach().numpy(), r.grad.numpy()
    import mlx.core as mx

    from stoa.algorithms.mlx_loss import OPS as MOPS

    a = mx.array(adv)

    def f(r):
        return clipped_surrogate(MOPS, r, a, EPS_LOW, EPS_HIGH, DUAL_C).sum()

    r = mx.array(ratio)
    loss = clipped_surrogate(MOPS, r, a, EPS_LOW, EPS_HIGH, DUAL_C)
    return np.array(loss), np.array(mx.grad(f)(r))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ratio_on_a_bound_keeps_its_gradient(backend: str) -> None:
    ratio = np.array([c[0] for c in EDGE_CASES], dtype=F32)
    adv = np.array([c[1] for c in EDGE_CASES], dtype=F32)
    loss, grad = _run(backend, ratio, adv)
    np.testing.assert_allclose(loss, [c[2] for c in EDGE_CASES], rtol=1e-6)
    np.testing.assert_array_equal(grad, np.array([c[3] for c in EDGE_CASES], dtype=F32))
