"""Run an algorithm's loss on numpy inputs with either backend; return loss, logit gradient, metrics."""

from __future__ import annotations

from typing import Any

import numpy as np

from stoa.algorithms import LossInputs


def run_loss(backend: str, algo: Any, logits: np.ndarray, tokens: np.ndarray, behaviour: np.ndarray,
             ref: np.ndarray | None, adv: np.ndarray, mask: np.ndarray, normalizer: float,
             version_lag: np.ndarray | None = None) -> tuple[float, np.ndarray, dict[str, float]]:
    """Forward + backward through token_logprobs and loss; the gradient is d loss / d logits."""
    f32 = np.float32
    if backend == "torch":
        import torch

        z = torch.tensor(logits.astype(f32), requires_grad=True)
        logp = algo.token_logprobs(z, torch.tensor(tokens))
        inp = LossInputs(logp, torch.tensor(behaviour.astype(f32)),
                         None if ref is None else torch.tensor(ref.astype(f32)),
                         torch.tensor(adv.astype(f32)), torch.tensor(mask.astype(f32)), normalizer, version_lag)
        loss, metrics = algo.loss(inp)
        loss.backward()
        assert z.grad is not None
        return float(loss.detach()), z.grad.numpy().astype(np.float64), metrics

    import mlx.core as mx

    def f(z: Any) -> tuple[Any, dict[str, float]]:
        logp = algo.token_logprobs(z, mx.array(tokens))
        inp = LossInputs(logp, mx.array(behaviour.astype(f32)), None if ref is None else mx.array(ref.astype(f32)),
                         mx.array(adv.astype(f32)), mx.array(mask.astype(f32)), normalizer, version_lag)
        return algo.loss(inp)

    (loss, metrics), grad = mx.value_and_grad(f)(mx.array(logits.astype(f32)))
    return float(loss.item()), np.array(grad, dtype=np.float64), metrics
