"""Multi-turn loss promises: no gradient off the actions, ECHO off is bit-identical, GiGPO without turns is GRPO."""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest

from stoa.algorithms import AlgoConfig, LossInputs, echo_coefficient, get_algorithm

from .conftest import BACKENDS
from .random_inputs import CONFIGS, TOKEN_ADVANTAGES, Batch, random_batch
from .runners import Extras, run_loss

ALL = list(CONFIGS)


def _run(backend: str, cfg: AlgoConfig, b: Batch, extras: Extras | None) -> tuple[float, np.ndarray, dict]:
    algo = get_algorithm(cfg, backend)
    return run_loss(backend, algo, b.logits, b.tokens, b.behaviour, b.ref, b.adv, b.mask, algo.normalizer(b.mask),
                    b.lag, extras)


def _multi_turn(key: str, cfg: AlgoConfig) -> Batch:
    b = random_batch(seed=11 + zlib.crc32(key.encode()), temperature=cfg.temperature, multi_turn=True,
                     token_advantages=cfg.name == "gigpo")
    assert b.extras is not None and b.extras.echo_mask is not None
    assert b.extras.echo_mask.sum() > 0 and ((b.mask == 0) & (b.extras.echo_mask == 0)).any()
    return b


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("key", ALL)
def test_no_gradient_off_the_action_tokens_when_echo_is_off(key: str, backend: str) -> None:
    """Observation and echo tokens (NaN behaviour and reference logprobs) get exactly zero logit gradient."""
    cfg = AlgoConfig.from_dict(CONFIGS[key])
    b = _multi_turn(key, cfg)
    assert b.extras is not None
    off = dataclasses.replace(b.extras, echo_alpha=0.0)
    loss, grad, _ = _run(backend, cfg, b, off)
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    non_action = b.mask == 0
    assert np.all(grad[non_action] == 0.0)
    assert np.abs(grad[~non_action]).max() > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("key", ["grpo", "gspo", "cispo", "gigpo_echo"])
def test_echo_term_reaches_echo_tokens_only(key: str, backend: str) -> None:
    """With ECHO on, echo tokens get exactly the NLL gradient alpha / N_echo * (softmax - onehot); masked
    observation tokens and padding still get none."""
    cfg = AlgoConfig.from_dict({**CONFIGS[key], "echo_alpha": 0.4})
    b = _multi_turn(key, cfg)
    assert b.extras is not None and b.extras.echo_mask is not None
    _, grad, metrics = _run(backend, cfg, b, b.extras)
    echo = b.extras.echo_mask > 0
    assert np.all(grad[(b.mask == 0) & ~echo] == 0.0)
    z = b.logits / cfg.temperature
    probs = np.exp(z - z.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = 0.4 / b.extras.echo_normalizer * (probs - np.eye(b.logits.shape[-1])[b.tokens]) / cfg.temperature
    np.testing.assert_allclose(grad[echo], want[echo], atol=1e-6, rtol=1e-5)
    assert metrics["echo_tokens"] == echo.sum()
    assert b.extras.echo_hits is not None
    assert metrics["echo_acc"] == pytest.approx(float(b.extras.echo_hits[echo].mean()), rel=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("key", ALL)
def test_echo_off_or_absent_is_bit_identical(key: str, backend: str) -> None:
    """alpha 0 with echo tokens, or alpha > 0 without any, leaves loss and gradient bit for bit as without ECHO."""
    cfg = AlgoConfig.from_dict({**CONFIGS[key], "echo_alpha": 0.0, "echo_schedule": "constant"})
    b = _multi_turn(key, cfg)
    assert b.extras is not None and b.extras.echo_mask is not None
    base = Extras(token_advantages=b.extras.token_advantages)
    loss0, grad0, m0 = _run(backend, cfg, b, base)
    loss1, grad1, m1 = _run(backend, cfg, b, dataclasses.replace(b.extras, echo_alpha=None))  # cfg alpha = 0
    none = dataclasses.replace(b.extras, echo_mask=np.zeros_like(b.extras.echo_mask), echo_alpha=0.9)
    loss2, grad2, _ = _run(backend, dataclasses.replace(cfg, echo_alpha=0.9), b, none)
    assert loss1 == loss0 and loss2 == loss0
    np.testing.assert_array_equal(grad1, grad0)
    np.testing.assert_array_equal(grad2, grad0)
    assert "loss_echo" not in m0 and m1["loss_echo"] > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_gigpo_on_single_turn_rows_is_grpo(backend: str) -> None:
    b = random_batch(seed=5)
    grpo = _run(backend, AlgoConfig.preset("grpo", kl_beta=0.05), b, None)
    gigpo = _run(backend, AlgoConfig.preset("gigpo", kl_beta=0.05), b, None)
    assert gigpo[0] == grpo[0]
    np.testing.assert_array_equal(gigpo[1], grpo[1])
    assert gigpo[2] == grpo[2]


def test_token_advantages_replace_the_row_advantages() -> None:
    """Equal token advantages on every token give the per-row loss exactly; gspo refuses token advantages."""
    cfg = AlgoConfig.preset("gigpo", kl_beta=0.05)
    b = random_batch(seed=3)
    rows = _run("torch", cfg, b, None)
    spread = _run("torch", cfg, b, Extras(token_advantages=np.repeat(b.adv[:, None], b.mask.shape[1], axis=1)))
    assert spread[0] == rows[0]
    np.testing.assert_array_equal(spread[1], rows[1])
    with pytest.raises(ValueError, match="^token_advantages: gspo"):
        _run("torch", AlgoConfig.preset("gspo"), b, Extras(token_advantages=np.zeros_like(b.mask)))
    assert "gigpo_echo" in TOKEN_ADVANTAGES


def test_loss_inputs_are_checked_naming_the_field() -> None:
    import torch

    algo = get_algorithm(AlgoConfig.preset("grpo", echo_alpha=0.5, echo_schedule="linear_taper_to_zero"), "torch")
    z = torch.zeros(2, 3)
    base = LossInputs(z, z, z, torch.zeros(2), torch.ones(2, 3), 2.0, echo_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="^echo_alpha: the 'linear_taper_to_zero' schedule needs"):
        algo.loss(base)
    algo.loss(dataclasses.replace(base, echo_alpha=algo.echo_coefficient(3, 4)))
    bad = [("echo_mask", torch.ones(2, 4)), ("echo_hits", torch.ones(3, 3)), ("token_advantages", torch.ones(2)),
           ("echo_normalizer", 0.0), ("echo_alpha", -0.1), ("echo_alpha", float("nan"))]
    for name, value in bad:
        with pytest.raises(ValueError, match=f"^{name}:"):
            algo.loss(dataclasses.replace(base, **{"echo_alpha": 0.1, name: value}))


def test_echo_coefficient_schedules() -> None:
    const = AlgoConfig.preset("grpo", echo_alpha=0.2)
    assert [echo_coefficient(const, s, 0) for s in (0, 5, 100)] == [0.2, 0.2, 0.2]
    taper = AlgoConfig.preset("dapo", echo_alpha=0.8, echo_schedule="linear_taper_to_zero")
    assert [echo_coefficient(taper, s, 4) for s in (0, 1, 2, 4, 9)] == [0.8, pytest.approx(0.6), 0.4, 0.0, 0.0]
    assert get_algorithm(taper, "torch").echo_coefficient(1, 4) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="^total_steps:"):
        echo_coefficient(taper, 1, 0)
    with pytest.raises(ValueError, match="^step:"):
        echo_coefficient(taper, -1, 4)
    off = AlgoConfig.preset("grpo", echo_schedule="linear_taper_to_zero")  # alpha 0: no total needed
    assert echo_coefficient(off, 3, 0) == 0.0
