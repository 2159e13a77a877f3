"""Engine result types shared by the torch and MLX engines (no torch, no mlx)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Completion:
    """One sampled completion with the behaviour logprob of each token."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass
class GenStats:
    """Timing and size figures of one ``generate`` call."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    new_tokens: int = 0
    steps: int = 0
    extra: dict[str, float] = field(default_factory=dict)
