"""Demonstrations for a run's cold start: what the policy should write, turn by turn, for a prompt (built by the
task, or read from a JSONL file of conversations: ``load_conversations``).

A task that can show its format implements ``demonstrations(n, rng) -> list[Demo]`` (``search``: search with
the question, read the documents, answer with the gold entity; ``walk``: the shortest walk, then the answer;
``arithmetic``: the answer). ``cold_start = "rft"`` needs none: it keeps the policy's own correct samples
(``stoa.episodes.rft``). A ``Demo`` holds text, not tokens: a task has no tokenizer and no tools. The
trainer's cold start (``stoa.trainer.coldstart``) tokenises each turn, runs the tool calls with its own tools and
builds the observations with the task's environment and ``stoa.envs.base.observation_tokens``, exactly as an
episode would have them; only the policy's turns (``ROLE_ACTION``) carry the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from stoa.tasks.base import Prompt
from stoa.untrusted import check_text, load_object

__all__ = ["ColdStartError", "Demo", "load_conversations", "task_demonstrations"]

MAX_LINE_BYTES = 1 << 20
"""Longest JSONL line read."""
MAX_MESSAGES = 64
"""Most messages of one conversation."""
_ROLES = ("system", "user", "assistant", "tool")


class ColdStartError(ValueError):
    """A demonstration that cannot be trained on (the message names its file and line, or the task)."""


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
        ColdStartError: the task builds no demonstrations (names the other ways to cold-start).
    """
    fn = getattr(task, "demonstrations", None)
    if not callable(fn):
        name = getattr(task, "id", type(task).__name__)
        raise ColdStartError(f"cold_start: task {name!r} builds no demonstrations; give cold_start a JSONL file "
                             "of conversations ({\"messages\": [...]}) or set it to '' ('rft' in the fleet trainer)")
    return cast(Callable[[int, np.random.Generator], list[Demo]], fn)


def load_conversations(path: str | Path, n: int) -> list[Demo]:
    """The first ``n`` conversations of a JSONL file, each ``{"messages": [{"role", "content"}, ...]}``: the
    messages before the first ``assistant`` one are the prompt, then ``assistant`` turns, each but the last
    followed by a ``tool`` message (the tool's result text). Every line is checked, not only the first ``n``.

    Args:
        path: the file.
        n: how many to keep.

    Raises:
        ColdStartError: no such file, or a line that is not such a conversation (names the file and line).
    """
    p = Path(path)
    if not p.is_file():
        raise ColdStartError(f"cold_start: no such file: {p}; give a JSONL file of conversations, 'demos' or ''")
    out: list[Demo] = []
    with p.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                demo = _conversation(load_object(line, "the line", max_bytes=MAX_LINE_BYTES), where)
            except ValueError as e:
                raise ColdStartError(f"cold_start: {where}: {str(e)[:300]}; fix or remove the line "
                                     "(nothing was trained)") from None
            if len(out) < n:
                out.append(demo)
    if not out:
        raise ColdStartError(f"cold_start: {p} holds no conversation; give at least one line")
    return out


def _conversation(obj: dict[str, Any], where: str) -> Demo:
    """One JSONL conversation as a ``Demo`` (``ValueError`` naming what is wrong)."""
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not 0 < len(msgs) <= MAX_MESSAGES:
        raise ValueError(f"'messages' must be a list of 1 to {MAX_MESSAGES} messages")
    parsed = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise ValueError(f"message {i} must be an object with 'role' one of {_ROLES}")
        parsed.append((m["role"], check_text(m.get("content"), f"message {i} 'content'", max_len=1 << 18)))
    first = next((i for i, (role, _) in enumerate(parsed) if role == "assistant"), None)
    if first is None or not any(role == "user" for role, _ in parsed[:first]):
        raise ValueError("a conversation needs a 'user' message, then an 'assistant' one")
    rest = parsed[first:]
    if any(role != ("assistant" if k % 2 == 0 else "tool") for k, (role, _) in enumerate(rest)) or len(rest) % 2 == 0:
        raise ValueError("after the prompt, messages must alternate assistant, tool, ..., ending with assistant")
    prompt = Prompt(where, tuple({"role": r, "content": c} for r, c in parsed[:first]), "")
    return Demo(prompt, tuple(c for _, c in rest[0::2]), source=where, tool_results=tuple(c for _, c in rest[1::2]))
