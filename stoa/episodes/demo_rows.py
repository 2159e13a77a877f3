"""Demonstrations as training rows: each conversation tokenised exactly as an episode of the run would be.

Shared by the fleet trainer's cold start (``stoa.trainer.coldstart``) and local mode's (``stoa.local``): the
prompt rendered with the run's chat template, each turn tokenised, each tool call run with the caller's own
tools and its observation built by the task's environment and ``observation_tokens``. Engine-free (no torch,
no mlx).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from stoa.envs.base import Tools, observation_tokens
from stoa.rollouts.episode import ROLE_ACTION
from stoa.tasks.demos import ColdStartError, Demo, load_conversations, task_demonstrations
from stoa.tasks.multiturn import is_multiturn

__all__ = ["Prepared", "SftRow", "build_rows", "prepare_rows"]


class SftRow(NamedTuple):
    """One demonstration as the trainer trains it: prompt ids, then the episode's tokens and their roles."""

    prompt: np.ndarray
    """int32 prompt token ids (the chat template's rendering, generation prompt included)."""
    tokens: np.ndarray
    """int32 ids after the prompt: the policy's turns and the observations between them."""
    roles: np.ndarray
    """int8 ``ROLE_*`` of each token; the loss reads ``ROLE_ACTION`` only."""


def build_rows(demos: Sequence[Demo], task: Any, codec: Any, tools: Tools | None, max_turn_tokens: int,
               strict: bool) -> tuple[list[SftRow], int]:
    """The rows of the demonstrations, and how many were dropped.

    Args:
        demos: the demonstrations.
        task: the run's task (its environment and limits for a multi-turn task).
        codec: the run's tokenizer (``TextCodec``).
        tools: the trainer's own tools (a multi-turn task), else None.
        max_turn_tokens: tokens one turn may hold (``max_new_tokens``).
        strict: raise on the first demonstration that cannot be used (a user's file); else drop it (the task's).

    Raises:
        ColdStartError: ``strict`` and a demonstration that cannot be used (names its ``source``).
    """
    rows, dropped = [], 0
    for demo in demos:
        try:
            rows.append(_row(demo, task, codec, tools, max_turn_tokens))
        except ColdStartError as e:
            if strict:
                raise ColdStartError(f"cold_start: {demo.source or task.id}: {e}; fix or remove it (nothing was "
                                     "trained)") from None
            dropped += 1
    return rows, dropped


def _row(demo: Demo, task: Any, codec: Any, tools: Tools | None, max_turn_tokens: int) -> SftRow:
    """One demonstration as a row (``ColdStartError`` naming what is wrong)."""
    prompt = np.asarray(codec.encode_prompt(demo.prompt.messages), np.int32)
    tokens: list[int] = []
    roles: list[int] = []
    multi = is_multiturn(task)
    if not multi and len(demo.turns) != 1:
        raise ColdStartError(f"a single-turn task takes one assistant turn, not {len(demo.turns)}")
    try:
        env = task.make_env(demo.prompt, 0) if multi else None
    except (ValueError, KeyError) as e:  # e.g. a walk prompt id the task cannot rebuild
        raise ColdStartError(f"the task builds no environment for this prompt ({str(e)[:200]})") from None
    seen = []
    for k, turn in enumerate(demo.turns):
        ids = codec.encode_text(turn) + ([] if multi or not codec.eos_ids else [_eos(codec)])
        if len(ids) > max_turn_tokens:
            raise ColdStartError(f"turn {k} is {len(ids)} tokens, over max_new_tokens = {max_turn_tokens}")
        tokens += ids
        roles += [ROLE_ACTION] * len(ids)
        if env is not None:
            seen += _observe(demo, k, env, tools, codec, task.limits, tokens, roles)
    if multi:
        _check_limits(demo, task.limits, tokens)
    if demo.evidence and not any(demo.evidence.lower() in text.lower() for text in seen):
        raise ColdStartError(f"no document shown holds the answer {demo.evidence!r}")
    return SftRow(prompt, np.asarray(tokens, np.int32), np.asarray(roles, np.int8))


def _eos(codec: Any) -> int:
    """The token that ends a single-turn completion: the tokenizer's EOS, else the first end token."""
    eos = getattr(codec.tok, "eos_token_id", None)
    return int(eos) if eos is not None else int(codec.eos_ids[0])


def _observe(demo: Demo, k: int, env: Any, tools: Tools | None, codec: Any, limits: Any, tokens: list[int],
             roles: list[int]) -> list[str]:
    """Append turn ``k``'s observation (none after the last turn, which must make no call); its texts."""
    call = env.parse(demo.turns[k])
    last = k == len(demo.turns) - 1
    if last:
        if call is not None:
            raise ColdStartError(f"the last turn makes a tool call ({call.name}); end with an answer")
        return []
    if call is None:
        raise ColdStartError(f"turn {k} makes no tool call, yet more turns follow")
    if tools is None:
        raise ColdStartError("the task's tools are not open")
    result = tools.run([call])[0]
    if k < len(demo.tool_results) and demo.tool_results[k].strip() != result.text.strip():
        raise ColdStartError(f"the tool result after turn {k} differs from what the trainer's tools return for "
                             f"{call.arguments[:80]!r}")
    obs_tokens, obs_roles = observation_tokens(env.observe(call, result), codec)
    if len(obs_tokens) > limits.max_obs_tokens:
        raise ColdStartError(f"the observation after turn {k} is {len(obs_tokens)} tokens, over max_obs_tokens = "
                             f"{limits.max_obs_tokens}")
    tokens += obs_tokens
    roles += obs_roles
    return [result.text]


def _check_limits(demo: Demo, limits: Any, tokens: list[int]) -> None:
    """Refuse an episode longer than the task's limits."""
    if len(demo.turns) > limits.max_turns:
        raise ColdStartError(f"{len(demo.turns)} turns, over max_turns = {limits.max_turns}")
    if len(tokens) > limits.max_total_tokens:
        raise ColdStartError(f"{len(tokens)} tokens after the prompt, over max_total_tokens = "
                             f"{limits.max_total_tokens}")


class Prepared(NamedTuple):
    """The cold start's rows and what to record about them."""

    rows: list[SftRow]
    """The rows to train on."""
    info: dict[str, Any]
    """Source (``demos``, ``rft`` or the file and its SHA-256), examples built and dropped."""


def prepare_rows(source: str, *, examples: int, seed: int, max_new_tokens: int, task: Any, codec: Any,
                 tools: Tools | None) -> Prepared:
    """The rows of a ``cold_start`` of demonstrations: the task's (``demos``; unusable ones dropped) or a JSONL
    file's (the first unusable one stops it, naming its line).

    Args:
        source: ``demos`` or the path of a JSONL file of conversations.
        examples: demonstrations to build (``cold_start_examples``).
        seed: the run's seed (which training questions the task demonstrates).
        max_new_tokens: tokens one turn may hold.
        task: the run's task; codec: its tokenizer; tools: its tools (None: a single-turn task).

    Raises:
        ColdStartError: no demonstrations, a bad file line (names the file and line), or none usable.
    """
    if source == "demos":
        demos = task_demonstrations(task)(examples, np.random.default_rng(seed))
        rows, dropped = build_rows(demos, task, codec, tools, max_new_tokens, strict=False)
        info: dict[str, Any] = {"source": "demos"}
    else:
        demos = load_conversations(source, examples)
        rows, dropped = build_rows(demos, task, codec, tools, max_new_tokens, strict=True)
        info = {"source": str(source), "sha256": hashlib.sha256(Path(source).read_bytes()).hexdigest()}
    if not rows:
        raise ColdStartError(f"cold_start: none of the {len(demos)} demonstrations of task {task.id!r} could be "
                             "used (over the limits, or no document shown holds the answer); raise "
                             "max_new_tokens or the task's limits, or give a JSONL file")
    return Prepared(rows, {**info, "examples": len(rows), "dropped": dropped})
