"""The ``Engine`` protocol of every generation engine, and what ``generate`` returns (no torch, no mlx)."""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from stoa.episodes.driver import Episode, EpisodeDriver


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


@runtime_checkable
class Engine(Protocol):
    """A generation engine: samples groups of completions and records the logprob of every token it sampled.

    The worker loop, the trainer's evaluation, local mode and the benchmarks use engines only through
    this protocol; ``stoa.engines.make_engine`` builds one by name (``torch`` or ``mlx``).
    """

    vocab_size: int
    """Rows of the model's output projection."""

    @property
    def dtype_name(self) -> str:
        """The compute dtype as a short name (``float32``, ``bfloat16``, ``float16``)."""
        ...

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        eos_ids: Sequence[int] = (),
        generator: Any = None,
        greedy: bool = False,
    ) -> tuple[list[list[Completion]], GenStats]:
        """Sample ``n`` completions for each prompt (one group per prompt).

        Args:
            prompts: token ids of each prompt.
            n: completions per prompt.
            max_new_tokens: length cap.
            temperature: sampling temperature.
            top_p: nucleus mass.
            eos_ids: tokens that end a completion (included in the completion).
            generator: the engine's random source (see ``make_generator``); None: its global one.
            greedy: take the argmax (evaluation); logprobs stay those of the temperature/top-p distribution.

        Returns:
            per prompt, its ``n`` completions; and timing figures.
        """
        ...

    def generate_episodes(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        driver: EpisodeDriver,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        generator: Any = None,
        greedy: bool = False,
    ) -> tuple[list[list[Episode]], GenStats]:
        """Run ``n`` multi-turn episodes of each prompt in one batch (``stoa.episodes.driver``).

        The prompt's prefill is shared by its rows; rows decode until they end or pause at a stop string;
        the paused rows' tools run in one request (``driver.resume``); each resumed row is fed its last
        sampled token and its observation on its own cache, positions contiguous, and decodes again.

        Args:
            prompts: token ids of each prompt.
            n: episodes per prompt.
            driver: the episodes of the ``len(prompts) * n`` rows (it holds the limits, tools and EOS ids).
            temperature: sampling temperature.
            top_p: nucleus mass.
            generator: the engine's random source (see ``make_generator``); None: its global one.
            greedy: take the argmax; logprobs stay those of the temperature/top-p distribution.

        Returns:
            per prompt, its ``n`` episodes; and timing figures (``extra`` holds the driver's ``stats``).

        Raises:
            ToolUnavailable: the tools could not answer (the caller may retry the batch later).
        """
        ...

    def load_weights(self, named: Mapping[str, np.ndarray]) -> None:
        """Load float32 arrays named as torch's ``named_parameters``; nothing loads on a mismatch.

        Args:
            named: parameter name -> float32 array of the parameter's shape.
        """
        ...

    def load_state(self, state: Mapping[str, np.ndarray], plane: str) -> None:
        """Load a published weight state (the plane's stored bits), as a worker receives it.

        Args:
            state: tensor name -> stored bits.
            plane: ``bf16`` or ``int8g64``.
        """
        ...

    def make_generator(self, seed: int | None) -> Any:
        """The ``generator`` to pass to ``generate`` for reproducible sampling.

        Args:
            seed: the seed; None for a fresh random one.
        """
        ...


class RowLog:
    """What each row of one ``generate`` call made so far (row ``g * n + j``: sample ``j`` of prompt ``g``).

    Args:
        rows: prompts x samples.
    """

    def __init__(self, rows: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.logprobs: list[list[float]] = [[] for _ in range(rows)]
        self.finish = ["length"] * rows

    def record(self, active: Sequence[int], tokens: Sequence[int], logprobs: Sequence[float],
               eos: Container[int]) -> list[int]:
        """Append one decode step's token and logprob to each row still decoding.

        Args:
            active: the row numbers still decoding, in batch order.
            tokens: the token sampled for each of them.
            logprobs: its logprob.
            eos: tokens that end a row (the row finishes with ``stop``).

        Returns:
            the batch positions (indices into ``active``) of the rows that go on.
        """
        keep: list[int] = []
        for i, (r, t, v) in enumerate(zip(active, tokens, logprobs, strict=True)):
            self.tokens[r].append(t)
            self.logprobs[r].append(v)
            if t in eos:
                self.finish[r] = "stop"
            else:
                keep.append(i)
        return keep

    def groups(self, n: int) -> list[list[Completion]]:
        """The completions, ``n`` per prompt, in prompt order.

        Args:
            n: samples per prompt.
        """
        k = len(self.tokens) // n
        rows = [Completion(*row) for row in zip(self.tokens, self.logprobs, self.finish, strict=True)]
        return [rows[g * n : (g + 1) * n] for g in range(k)]
