"""The MLX sampling distribution equals the numpy reference and the torch engine's on identical logits."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from stoa.engines.mlx.sampling import make_key, sampling_logprobs_mlx
from stoa.engines.sampling import sampling_logprobs_np

pytestmark = pytest.mark.mlx

CASES = [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9), (1.3, 0.5), (0.5, 0.05), (1.0, 0.999)]


def _logits(seed: int = 0, shape: tuple[int, int] = (16, 50)) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * 3).astype(np.float32)


def _check(got: np.ndarray, ref: np.ndarray, atol: float = 1e-5) -> None:
    assert np.array_equal(np.isinf(ref), np.isinf(got)), "different nucleus"
    fin = np.isfinite(ref)
    np.testing.assert_allclose(got[fin], ref[fin], atol=atol)
    np.testing.assert_allclose(np.exp(got).sum(-1), 1.0, atol=1e-5)


@pytest.mark.parametrize("temperature,top_p", CASES)
def test_mlx_matches_numpy_reference(temperature: float, top_p: float) -> None:
    logits = _logits()
    got = np.array(sampling_logprobs_mlx(mx.array(logits), temperature, top_p)).astype(np.float64)
    _check(got, sampling_logprobs_np(logits, temperature, top_p))


@pytest.mark.parametrize("temperature,top_p", CASES)
def test_mlx_matches_torch(temperature: float, top_p: float) -> None:
    torch = pytest.importorskip("torch", reason="the comparison needs torch")
    from stoa.engines.torch import sampling_logprobs_torch

    logits = _logits(1, (8, 300))
    got = np.array(sampling_logprobs_mlx(mx.array(logits), temperature, top_p))
    ref = sampling_logprobs_torch(torch.from_numpy(logits), temperature, top_p).numpy()
    _check(got.astype(np.float64), ref.astype(np.float64), atol=2e-6)


def test_crossing_token_kept() -> None:
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    lp = np.array(sampling_logprobs_mlx(mx.array(logits), 1.0, 0.7))[0]
    assert np.isfinite(lp[:2]).all() and np.isinf(lp[2:]).all()
    np.testing.assert_allclose(np.exp(lp[:2]), [0.625, 0.375], rtol=1e-6)


def test_ties_at_the_edge_keep_lower_ids_like_numpy() -> None:
    # Five equal tokens of mass 0.2: top_p = 0.5 keeps three, and numpy's stable sort keeps the lowest ids.
    logits = np.array([[0.0, 0.0, 0.0, 0.0, 0.0, -30.0], [-30.0, 1.0, 1.0, 2.0, 1.0, 1.0]], np.float32)
    for top_p in (0.5, 0.3, 0.7):
        ref = sampling_logprobs_np(logits, 1.0, top_p)
        got = np.array(sampling_logprobs_mlx(mx.array(logits), 1.0, top_p)).astype(np.float64)
        _check(got, ref)


def test_bf16_logits_are_widened() -> None:
    logits = _logits(2, (4, 64))
    lp16 = sampling_logprobs_mlx(mx.array(logits).astype(mx.bfloat16), 1.0, 0.9)
    assert lp16.dtype == mx.float32
    ref = sampling_logprobs_np(np.array(mx.array(logits).astype(mx.bfloat16).astype(mx.float32)), 1.0, 0.9)
    _check(np.array(lp16).astype(np.float64), ref)


def test_make_key() -> None:
    assert make_key(None) is None
    k = make_key(7)
    assert k is not None and np.array_equal(np.array(k), np.array(mx.random.key(7)))
    key = mx.random.key(3)
    assert make_key(key) is key
    with pytest.raises(TypeError, match="generator"):
        make_key("7")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="generator"):
        make_key(True)
