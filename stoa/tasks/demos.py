"""Demonstrations for a run's cold start: what the policy should write, turn by turn, for a prompt.

A task that can show its format implements ``demonstrations(n, rng) -> list[Demo]`` (``search``: search with
the question, read the documents, answer with the gold entity; ``arithmetic``: the answer). A ``Demo`` holds
text, not tokens: a task has no tokenizer and no tools. The trainer's cold start (``stoa.trainer.coldstart``)
tokenises each turn, runs the tool calls with its own tools and builds the observations with the task's
environment and ``stoa.envs.base.observation_tokens``, exactly as an episode would have them; only the
policy's turns (``ROLE_ACTION``) carry the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from stoa.tasks.base import Prompt

__all__ = ["Demo", "task_demonstrations"]


@dataclass(frozen=True)
class Demo:
    """One demonstration: a prompt and the policy's turns."""

    prompt: Prompt
    """The task's prompt (its messages are rendered with the run's chat template)."""
    turns: tuple[str, ...]
    """The policy's turns, in order. Multi-turn: every turn but the last makes a tool call (ends at a stop
    string); the environment's observation follows it. Single-turn: exactly one (the completion)."""
    evidence: str = ""
    """Text an observation must hold for the demo to be kept (the answer read, not guessed); empty: no check."""
    tool_results: tuple[str, ...] = ()
    """The tool results a conversation claims (a JSONL file's ``tool`` messages); each must equal what the
    trainer's own tools return for the call. Empty: nothing claimed."""
    source: str = ""
    """Where it came from, for messages (``path:line`` of a JSONL file; empty: the task)."""


def task_demonstrations(task: Any) -> Callable[[int, np.random.Generator], list[Demo]]:
    """The task's ``demonstrations`` method.

    Args:
        task: the run's task.

    Raises:
        ValueError: the task builds no demonstrations (names the other ways to cold-start).
    """
    fn = getattr(task, "demonstrations", None)
    if not callable(fn):
        raise ValueError(f"cold_start: task {getattr(task, 'id', type(task).__name__)!r} builds no demonstrations; "
                         "give cold_start a JSONL file of conversations ({\"messages\": [...]}) or set it to ''")
    return cast(Callable[[int, np.random.Generator], list[Demo]], fn)
