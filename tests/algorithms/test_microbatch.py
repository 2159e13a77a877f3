"""Summing micro-batch losses and gradients reproduces the whole-batch step, for every algorithm."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from stoa.algorithms import AlgoConfig, combine_metrics, get_algorithm

from .conftest import BACKENDS, HAS_MLX
from .random_inputs import CONFIGS, MULTI_TURN, TOKEN_ADVANTAGES, Batch, random_batch
from .runners import run_loss

SPLITS = [[0, 1], [2, 3, 4], [5]]


def _run(backend: str, cfg: AlgoConfig, batch: Batch, rows: list[int], normalizer: float):
    algo = get_algorithm(cfg, backend)
    idx = np.array(rows)
    extras = None if batch.extras is None else batch.extras.rows(idx)
    return run_loss(backend, algo, batch.logits[idx], batch.tokens[idx], batch.behaviour[idx], batch.ref[idx],
                    batch.adv[idx], batch.mask[idx], normalizer, batch.lag[idx], extras)


def make_batch(key: str, seed: int, cfg: AlgoConfig) -> Batch:
    """The random batch of a config: multi-turn roles, token advantages and the taper's coefficient as needed."""
    alpha = cfg.echo_alpha * 0.6 if cfg.echo_schedule != "constant" else None
    return random_batch(seed=seed, temperature=cfg.temperature, multi_turn=key in MULTI_TURN,
                        token_advantages=key in TOKEN_ADVANTAGES, echo_alpha=alpha)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("key", list(CONFIGS))
def test_micro_batches_sum_to_whole_batch(key: str, backend: str) -> None:
    cfg = AlgoConfig.from_dict(CONFIGS[key])
    batch = make_batch(key, zlib.crc32(key.encode()), cfg)
    normalizer = get_algorithm(cfg, backend).normalizer(batch.mask)
    loss, grad, metrics = _run(backend, cfg, batch, list(range(6)), normalizer)
    total, grads, parts = 0.0, np.zeros_like(grad), []
    for rows in SPLITS:
        part_loss, part_grad, part_metrics = _run(backend, cfg, batch, rows, normalizer)
        total += part_loss
        grads[np.array(rows)] = part_grad  # rows are disjoint: each micro-batch owns its logits
        parts.append(part_metrics)
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    assert np.abs(grad).max() > 0
    assert total == pytest.approx(loss, abs=1e-6, rel=1e-5)
    np.testing.assert_allclose(grads, grad, atol=1e-7, rtol=1e-5)
    merged = combine_metrics(parts)
    assert set(merged) == set(metrics)
    for k, v in metrics.items():
        assert merged[k] == pytest.approx(v, abs=1e-6, rel=1e-5), k


@pytest.mark.mlx
@pytest.mark.skipif(not HAS_MLX, reason="mlx is not importable")
@pytest.mark.parametrize("key", list(CONFIGS))
def test_torch_and_mlx_agree(key: str) -> None:
    cfg = AlgoConfig.from_dict(CONFIGS[key])
    batch = make_batch(key, 7 + zlib.crc32(key.encode()), cfg)
    rows = list(range(6))
    normalizer = get_algorithm(cfg, "torch").normalizer(batch.mask)
    lt, gt, mt = _run("torch", cfg, batch, rows, normalizer)
    lm, gm, mm = _run("mlx", cfg, batch, rows, normalizer)
    assert lm == pytest.approx(lt, abs=1e-6, rel=1e-5)
    np.testing.assert_allclose(gm, gt, atol=1e-6, rtol=1e-4)
    assert set(mm) == set(mt)
    for k in mt:
        assert mm[k] == pytest.approx(mt[k], abs=1e-6, rel=1e-5), k
