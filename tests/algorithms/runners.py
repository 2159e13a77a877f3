"""Run an algorithm's loss on numpy inputs with either backend; return loss, logit gradient, metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from stoa.algorithms import LossInputs


@dataclass
class Extras:
    """The optional multi-turn inputs of ``LossInputs`` as numpy arrays (None: not given)."""

    token_advantages: np.ndarray | None = None
    echo_mask: np.ndarray | None = None
    echo_normalizer: float = 1.0
    echo_alpha: float | None = None
    echo_hits: np.ndarray | None = None

    def rows(self, idx: np.ndarray) -> Extras:
        """The extras of the rows ``idx`` (the echo normaliser stays the whole batch's)."""
        def take(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[idx]

        return Extras(take(self.token_advantages), take(self.echo_mask), self.echo_normalizer, self.echo_alpha,
                      take(self.echo_hits))


def run_loss(backend: str, algo: Any, logits: np.ndarray, tokens: np.ndarray, behaviour: np.ndarray,
             ref: np.ndarray | None, adv: np.ndarray, mask: np.ndarray, normalizer: float,
             version_lag: np.ndarray | None = None, extras: Extras | None = None
             ) -> tuple[float, np.ndarray, dict[str, float]]:
    """Forward + backward through token_logprobs and loss; the gradient is d loss / d logits."""
    f32 = np.float32
    ex = extras or Extras()
    if backend == "torch":
        import torch

        def tt(a: np.ndarray | None) -> torch.Tensor | None:
            return None if a is None else torch.tensor(a.astype(f32))

        z = torch.tensor(logits.astype(f32), requires_grad=True)
        logp = algo.token_logprobs(z, torch.tensor(tokens))
        inp = LossInputs(logp, torch.tensor(behaviour.astype(f32)), tt(ref), torch.tensor(adv.astype(f32)),
                         torch.tensor(mask.astype(f32)), normalizer, version_lag, tt(ex.token_advantages),
                         tt(ex.echo_mask), ex.echo_normalizer, ex.echo_alpha, tt(ex.echo_hits))
        loss, metrics = algo.loss(inp)
        loss.backward()
        assert z.grad is not None
        return float(loss.detach()), z.grad.numpy().astype(np.float64), metrics

    import mlx.core as mx

    def mt(a: np.ndarray | None) -> Any:
        return None if a is None else mx.array(a.astype(f32))

    def f(z: Any) -> tuple[Any, dict[str, float]]:
        logp = algo.token_logprobs(z, mx.array(tokens))
        inp = LossInputs(logp, mx.array(behaviour.astype(f32)), mt(ref), mx.array(adv.astype(f32)),
                         mx.array(mask.astype(f32)), normalizer, version_lag, mt(ex.token_advantages),
                         mt(ex.echo_mask), ex.echo_normalizer, ex.echo_alpha, mt(ex.echo_hits))
        return algo.loss(inp)

    (loss, metrics), grad = mx.value_and_grad(f)(mx.array(logits.astype(f32)))
    return float(loss.item()), np.array(grad, dtype=np.float64), metrics
