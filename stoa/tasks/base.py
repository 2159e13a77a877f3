"""Task interface shared by workers and trainer: prompts addressed by stable ids, exact rewards."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "Prompt",
    "PromptIdError",
    "RewardError",
    "RewardFunctionError",
    "Task",
    "TaskDataError",
    "TaskOptionError",
    "TaskPluginError",
    "chat_messages",
    "check_prompt_version",
    "coerce_options",
    "format_prompt_id",
    "parse_prompt_id",
]


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task.

    Attributes:
        id: stable id such as "train:123456" or "test:42"; the trainer regenerates the prompt from it.
        messages: chat messages ({"role": ..., "content": ...}), rendered by a chat template elsewhere.
        answer: ground truth in canonical string form.
    """

    id: str
    messages: tuple[dict[str, str], ...]
    answer: str


@runtime_checkable
class Task(Protocol):
    """What every task provides; both worker kinds and the trainer use only this."""

    id: str
    reward_version: str

    def spec(self) -> dict[str, object]:
        """JSON-able knobs for the run contract (both sides must agree on them)."""
        ...

    def get(self, prompt_id: str) -> Prompt:
        """The prompt with this id; `PromptIdError` (a KeyError and a ValueError) if malformed or unknown."""
        ...

    def sample_train(self, rng: np.random.Generator) -> Prompt:
        """A random training prompt."""
        ...

    def heldout(self, n: int) -> list[Prompt]:
        """The first n prompts of the deterministic held-out split (disjoint from training)."""
        ...

    def reward(self, prompt: Prompt, completion: str) -> float:
        """Exact verifier reward in [0, 1]."""
        ...

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        """Whether the completion's final answer equals the ground truth."""
        ...


class TaskDataError(RuntimeError):
    """A task's data cannot be had: a hub dataset that cannot be fetched (no network), or a reader that is not
    installed; the message names the fix (e.g. a local jsonl path). A user error (exit 2), never a fallback."""


class TaskOptionError(TaskDataError, ValueError):
    """A task option names a missing or malformed file, or has a bad value; the message names the option and
    the fix. Also a ``ValueError``, so callers that can do without the task's data (a dry run's estimate)
    still catch it."""


class TaskPluginError(ValueError):
    """A task plugin that cannot be used: its module does not import, the name is not a class, or the class does
    not meet the ``Task`` protocol; the message names the plugin and the fix (exit 14). Raised before anything is
    written to the bucket."""


class RewardFunctionError(TaskPluginError):
    """A reward function that cannot be called as the task needs: wrong signature, or a probe call that returns
    the wrong number of rewards or something that is not a number (exit 15). Found at start-up."""


class RewardError(ValueError):
    """One group's reward could not be computed: the task's reward code raised, hung past its deadline, or
    returned something that is not a finite number, or the wrong number of rewards. The trainer rejects that
    record with ``reason`` and goes on; a worker drops the group; an evaluation scores the prompt 0."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        """``reward_raised``, ``reward_timeout``, ``reward_not_finite`` or ``reward_wrong_length``."""


class PromptIdError(ValueError, KeyError):
    """A prompt id that is malformed or names no prompt; catchable as ValueError or KeyError."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


_ID = re.compile(r"(?P<split>[a-z]+):(?P<index>0|[1-9][0-9]*)")


def format_prompt_id(split: str, index: int) -> str:
    """The canonical id "<split>:<index>".

    Args:
        split: split name, e.g. "train" or "test".
        index: non-negative index within the split.
    """
    if index < 0:
        raise ValueError(f"prompt index must be >= 0, got {index}")
    return f"{split}:{index}"


def parse_prompt_id(task_id: str, prompt_id: str, splits: tuple[str, ...]) -> tuple[str, int]:
    """Split a canonical prompt id into (split, index).

    Args:
        task_id: task name, used in error messages.
        prompt_id: the id to parse; must be "<split>:<index>" with a decimal index without leading
            zeros, so every prompt has exactly one id.
        splits: the split names this task accepts.

    Raises:
        PromptIdError: the id is not a string, not canonical, or names an unknown split.
    """
    if not isinstance(prompt_id, str):
        raise PromptIdError(f"{task_id}: prompt id must be a str, got {type(prompt_id).__name__}")
    m = _ID.fullmatch(prompt_id)
    if m is None:
        raise PromptIdError(
            f"{task_id}: malformed prompt id {prompt_id!r}; expected '<split>:<index>' with split in "
            f"{list(splits)} and a non-negative decimal index without leading zeros, e.g. '{splits[0]}:0'"
        )
    split = m.group("split")
    if split not in splits:
        raise PromptIdError(
            f"{task_id}: unknown split {split!r} in prompt id {prompt_id!r}; known: {list(splits)}"
        )
    return split, int(m.group("index"))


def check_prompt_version(task_id: str, given: int | None, current: int) -> None:
    """Fail when a run was started with prompts of another version than this code builds.

    Args:
        task_id: task name, used in the error message.
        given: the `prompt_version` option (from a run contract's task spec), or None for no check.
        current: the version this code builds.

    Raises:
        ValueError: `given` is set and differs from `current`; the message names the option.
    """
    if given is not None and given != current:
        raise ValueError(
            f"{task_id}: option 'prompt_version' is {given}, but this version of stoa builds {task_id} "
            f"prompts of version {current}; use the stoa version the run was started with"
        )


def chat_messages(user: str, system: str = "") -> tuple[dict[str, str], ...]:
    """Chat messages for a single-turn prompt, with an optional system message first.

    Args:
        user: the user message.
        system: system message; empty means none.
    """
    msgs: list[dict[str, str]] = []
    if system:
        msgs.append({"role": "system", "content": system})
    msgs.append({"role": "user", "content": user})
    return tuple(msgs)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _coerce(task_id: str, name: str, kind: type, value: object) -> object:
    """One option value converted to `kind` (from its own type or from a string)."""
    where = f"{task_id}: option {name!r}"
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(f"{where} must be a boolean (true/false), got {value!r}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ValueError(f"{where} must be an integer, got {value!r}")
    if kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ValueError(f"{where} must be a number, got {value!r}")
    if kind is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{where} must be a string, got {value!r}")
    if kind is tuple:  # a repeatable option (``reward=a:f,reward=b:g``): a tuple of strings
        items = (value,) if isinstance(value, str) else value
        if isinstance(items, list | tuple) and all(isinstance(v, str) for v in items):
            return tuple(items)
        raise ValueError(f"{where} must be one or more strings, got {value!r}")
    raise TypeError(f"{where}: unsupported option type {kind.__name__}")  # pragma: no cover


def coerce_options(
    task_id: str, declared: Mapping[str, type], options: Mapping[str, object]
) -> dict[str, Any]:
    """Check option names against a task's declared options and convert values to their types.

    Strings are converted ("2" -> 2 for an int option), so options parsed from a command line and
    options passed from Python go through the same checks.

    Args:
        task_id: task name, used in error messages.
        declared: option name -> type (bool, int, float, str, or tuple for a repeatable option whose values
            are strings).
        options: the given options.

    Raises:
        ValueError: an unknown option or a value of the wrong type; the message names the option.
    """
    out: dict[str, Any] = {}
    for name, value in options.items():
        if name not in declared:
            raise ValueError(f"{task_id}: unknown option {name!r}; known options: {sorted(declared)}")
        out[name] = _coerce(task_id, name, declared[name], value)
    return out
