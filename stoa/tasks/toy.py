"""A toy task with a dense, easily learnable reward, for smoke and integration tests on tiny models."""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from stoa.tasks.base import Prompt, chat_messages, format_prompt_id, parse_prompt_id


class ToyTask:
    """Reward = fraction of the completion's characters that are in ``chars`` (default: vowels).

    A random tiny model starts near the uniform rate and GRPO raises it within a few steps, which
    makes "the reward mean rises" a fast, reliable end-to-end check. Not a benchmark.

    Args:
        chars: the characters to produce.
        prompt_version: accepted for contract round trips; must be 1.
    """

    id: str = "toy"
    reward_version: str = "1"
    OPTIONS: ClassVar[dict[str, type]] = {"chars": str, "prompt_version": int}

    def __init__(self, chars: str = "aeiou", prompt_version: int | None = None) -> None:
        if not chars:
            raise ValueError("toy: option 'chars' must not be empty")
        if prompt_version not in (None, 1):
            raise ValueError(f"toy: option 'prompt_version' is {prompt_version}, this code builds 1")
        self.chars = chars

    def spec(self) -> dict[str, object]:
        """Options for the run contract."""
        return {"chars": self.chars, "prompt_version": 1}

    def get(self, prompt_id: str) -> Prompt:
        """The prompt with this id ("train:<i>" or "test:<i>").

        Args:
            prompt_id: canonical id.
        """
        split, index = parse_prompt_id(self.id, prompt_id, ("train", "test"))
        text = f"Write only these characters: {self.chars} ({split} {index % 97})"
        return Prompt(prompt_id, chat_messages(text), self.chars)

    def sample_train(self, rng: np.random.Generator) -> Prompt:
        """A random training prompt.

        Args:
            rng: random generator.
        """
        return self.get(format_prompt_id("train", int(rng.integers(0, 1_000_000))))

    def heldout(self, n: int) -> list[Prompt]:
        """The first ``n`` held-out prompts.

        Args:
            n: how many.
        """
        return [self.get(format_prompt_id("test", i)) for i in range(n)]

    def reward(self, prompt: Prompt, completion: str) -> float:
        """Fraction of characters that are in ``chars``.

        Args:
            prompt: the prompt (its answer holds the characters).
            completion: completion text.
        """
        if not completion:
            return 0.0
        return sum(ch in prompt.answer for ch in completion) / len(completion)

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        """At least half of the characters are in ``chars``.

        Args:
            prompt: the prompt.
            completion: completion text.
        """
        return self.reward(prompt, completion) >= 0.5
