"""Multi-turn tasks: a ``Task`` that also builds one environment per prompt and the tools its calls need.

The engines run episodes with ``task.make_env(prompt, seed)`` per row and one ``task.make_tools(searcher)`` per
batch; the trainer replays each record with its own tools. A task's ``limits`` hold every limit but the
per-turn one: ``max_turn_tokens`` is the run contract's ``max_new_tokens`` (``episode_limits`` joins them), so
``spec()`` carries only ``max_turns``, ``max_obs_tokens`` and ``max_total_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol, runtime_checkable

from stoa.envs.base import Environment, ToolResult, Tools, result_hash
from stoa.retrieval.base import Searcher
from stoa.rollouts.episode import EpisodeLimits, ToolCall
from stoa.tasks.base import Prompt, Task

__all__ = [
    "LIMIT_OPTIONS",
    "TOOL_KINDS",
    "LocalTools",
    "MultiTurnTask",
    "episode_limits",
    "is_multiturn",
    "limits_spec",
    "task_limits",
]

TOOL_KINDS = ("search", "local")
"""``search``: the tools need a ``Searcher`` (a retriever); ``local``: the task answers its own calls."""

LIMIT_OPTIONS: dict[str, type] = {"max_turns": int, "max_obs_tokens": int, "max_total_tokens": int}
"""The limit options every multi-turn task declares (``max_turn_tokens`` is the contract's ``max_new_tokens``)."""


@runtime_checkable
class MultiTurnTask(Task, Protocol):
    """A task whose episodes are several model turns answered by tools."""

    limits: EpisodeLimits
    """The episode limits; ``max_turn_tokens`` is a placeholder until ``episode_limits`` sets it."""
    tool_kind: str
    """One of ``TOOL_KINDS``."""

    def make_env(self, prompt: Prompt, seed: int) -> Environment:
        """A fresh environment for one episode of this prompt.

        Args:
            prompt: the prompt (from ``get``).
            seed: the episode's seed (the record's ``env_seed``).
        """
        ...

    def make_tools(self, searcher: Searcher | None) -> Tools:
        """The tools that answer this task's calls.

        Args:
            searcher: the retriever for ``tool_kind == "search"``; None for ``local``.
        """
        ...


def is_multiturn(task: object) -> bool:
    """Whether ``task`` is a multi-turn task (limits, a tool kind, ``make_env`` and ``make_tools``).

    Args:
        task: any task.
    """
    return (
        isinstance(getattr(task, "limits", None), EpisodeLimits)
        and getattr(task, "tool_kind", None) in TOOL_KINDS
        and callable(getattr(task, "make_env", None))
        and callable(getattr(task, "make_tools", None))
    )


def episode_limits(task: MultiTurnTask, max_new_tokens: int) -> EpisodeLimits:
    """The task's limits with the per-turn cap set to the contract's ``max_new_tokens``.

    Args:
        task: a multi-turn task.
        max_new_tokens: tokens the policy may sample in one turn.
    """
    return replace(task.limits, max_turn_tokens=int(max_new_tokens))


def task_limits(task_id: str, max_turns: int, max_obs_tokens: int, max_total_tokens: int) -> EpisodeLimits:
    """Episode limits from a task's options, checked (``max_turn_tokens`` left at its default).

    Args:
        task_id: the task, for messages.
        max_turns: model turns per episode.
        max_obs_tokens: tokens of one observation.
        max_total_tokens: tokens after the prompt.

    Raises:
        ValueError: a limit below 1; the message names the option.
    """
    values = {"max_turns": max_turns, "max_obs_tokens": max_obs_tokens, "max_total_tokens": max_total_tokens}
    for name, value in values.items():
        if int(value) < 1:
            raise ValueError(f"{task_id}: option {name!r} must be >= 1, got {value}")
    return EpisodeLimits(max_turns=int(max_turns), max_obs_tokens=int(max_obs_tokens),
                         max_total_tokens=int(max_total_tokens))


def limits_spec(limits: EpisodeLimits) -> dict[str, int]:
    """The limit options of a spec (everything but ``max_turn_tokens``).

    Args:
        limits: the task's limits.
    """
    return {name: int(getattr(limits, name)) for name in LIMIT_OPTIONS}


class LocalTools:
    """Tools a task answers itself: each call's result is its argument text (the env interprets it).

    The digest hashes the call's name and argument, so a replay names a call that differs.
    """

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """One result per call, in order.

        Args:
            calls: the calls of every paused row.
        """
        return [ToolResult(text=c.arguments, digest=result_hash([c.name, c.arguments])) for c in calls]
