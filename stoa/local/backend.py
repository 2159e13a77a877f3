"""The Backend protocol the local loop drives (rollout, logprobs, ref logprobs, step), and what both backends share."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from stoa.algorithms import Algorithm
from stoa.algorithms.batch import Batch
from stoa.engines import Completion, GenStats
from stoa.episodes.demo_rows import SftRow
from stoa.local.targets import choose_targets as choose_targets  # re-exported: the backends import it here

ADAPTER_LEAVES = ("lora_a", "lora_b")
"""The only parameter names (last path component) that may be trainable."""


@dataclass
class ModelSummary:
    """What ``stoa local smoke`` prints about a loaded model object."""

    model_id: str
    backend: str
    layers: int
    quant_bits: int
    targets_per_layer: list[list[str]]
    total_params: int
    trainable_params: int
    trainable_names: list[str]
    quantized_linears: int
    extra: dict[str, Any] = field(default_factory=dict)

    def non_adapter_trainable(self) -> list[str]:
        """Trainable leaves that are not LoRA adapter matrices (must be empty)."""
        return [n for n in self.trainable_names if n.rsplit(".", 1)[-1] not in ADAPTER_LEAVES]


class Backend(Protocol):
    """One model object (quantized base + LoRA) that samples, scores and trains; numpy in, numpy out."""

    name: str
    summary: ModelSummary
    engine: Any
    """The engine on this very model object (``generate``, ``generate_episodes``): multi-turn episodes and
    evaluations sample with it."""

    def sampling(self) -> AbstractContextManager[Any]:
        """The context the engine samples in (torch: eval mode and the compute autocast; MLX: nothing)."""
        ...

    def generator(self, seed: int) -> Any:
        """The engine's random source for ``seed`` (torch: a seeded ``torch.Generator``; MLX: the seed)."""
        ...

    def rollout(self, prompts: Sequence[Sequence[int]], n: int, *, max_new_tokens: int, temperature: float,
                top_p: float, eos_ids: Sequence[int], seed: int, greedy: bool = False
                ) -> tuple[list[list[Completion]], GenStats]:
        """Sample ``n`` completions per prompt (one prefill per prompt, shared KV, batched decode)."""
        ...

    def logprobs(self, batch: Batch, micro: Sequence[np.ndarray]) -> np.ndarray:
        """[B, T] logprobs of every row's tokens from a full forward, no gradient (the old policy)."""
        ...

    def ref_logprobs(self, batch: Batch, micro: Sequence[np.ndarray]) -> np.ndarray:
        """[B, T] logprobs with the adapters disabled (the reference policy), no gradient."""
        ...

    def accumulate(self, batch: Batch, micro: Sequence[np.ndarray], algo: Algorithm,
                   echo_alpha: float | None = None) -> dict[str, float]:
        """Forward/backward every micro-batch, summing gradients; returns combined loss diagnostics.
        ``echo_alpha``: this step's ECHO coefficient (``Algorithm.echo_coefficient``; None: the config's)."""
        ...

    def grad_arrays(self) -> dict[str, np.ndarray]:
        """The accumulated adapter gradients by name (float32 copies)."""
        ...

    def apply_update(self) -> float:
        """Clip, take one AdamW step, clear the gradients; returns the pre-clip gradient norm."""
        ...

    def clear_grads(self) -> None:
        """Drop accumulated gradients without stepping."""
        ...

    def step(self, batch: Batch, micro: Sequence[np.ndarray], algo: Algorithm,
             echo_alpha: float | None = None) -> dict[str, float]:
        """``accumulate`` then ``apply_update``; diagnostics plus ``grad_norm``."""
        ...

    def sft_step(self, rows: Sequence[SftRow], micro: Sequence[np.ndarray], lr: float) -> SftResult:
        """One cold-start step: cross-entropy of the rows' action tokens (``ROLE_ACTION``; prompts and
        observations carry none), the mean over the step's action tokens, one forward/backward per micro-batch,
        then a clipped AdamW step of the cold start's own optimizer (made on the first call, ``weight_decay``
        0; the RL optimizer is untouched)."""
        ...

    def adapter_arrays(self) -> dict[str, np.ndarray]:
        """Adapter weights by name (mlx-lm naming: ``model.layers.0.self_attn.q_proj.lora_a``), float32."""
        ...

    def load_adapter_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Overwrite the adapters (same names and shapes as ``adapter_arrays``; anything else is refused)."""
        ...

    def optimizer_arrays(self) -> tuple[dict[str, np.ndarray], int]:
        """AdamW moments as ``m/<name>`` and ``v/<name>`` float32 arrays, and the optimizer step count."""
        ...

    def load_optimizer_arrays(self, arrays: dict[str, np.ndarray], step: int) -> None:
        """Restore ``optimizer_arrays`` output."""
        ...

    def logits_shape(self, prompt: Sequence[int]) -> tuple[int, ...]:
        """Shape of the full-vocabulary logits of one forward over ``prompt`` (smoke check)."""
        ...

    def peak_memory_mb(self) -> float:
        """The backend allocator's peak in MB since start (0 where it keeps none)."""
        ...


class SftResult(NamedTuple):
    """What one cold-start step (``Backend.sft_step``) reports."""

    loss: float
    """Mean cross-entropy per action token, before the update."""
    tokens: int
    """Action tokens the step trained on."""


def check_same_arrays(have: dict[str, np.ndarray], got: dict[str, np.ndarray], what: str) -> None:
    """Raise ValueError naming the first missing, unexpected or misshaped tensor of a loaded state.

    Args:
        have: the model's arrays (names and shapes are the reference).
        got: the arrays being loaded.
        what: 'adapter' or 'optimizer', for the message.
    """
    missing, extra = sorted(set(have) - set(got)), sorted(set(got) - set(have))
    if missing or extra:
        first = f"missing {missing[0]!r}" if missing else f"unexpected {extra[0]!r}"
        raise ValueError(f"{what} state does not match the model: {first} (missing {len(missing)}, "
                         f"unexpected {len(extra)})")
    for k, v in have.items():
        if tuple(np.shape(got[k])) != tuple(v.shape):
            raise ValueError(f"{what} state: {k} has shape {tuple(np.shape(got[k]))}, the model {tuple(v.shape)}")


def derive_seed(seed: int, step: int, salt: int = 0) -> int:
    """A 31-bit seed for step ``step``: sampling is a pure function of (seed, step), so a resumed run samples
    exactly what an uninterrupted one would.

    Args:
        seed: the run's seed.
        step: the step (or evaluation) index.
        salt: separates streams (0 rollout, 1 evaluation).
    """
    return int(np.random.SeedSequence([seed, step, salt]).generate_state(1)[0] & 0x7FFFFFFF)
