"""The environment protocol of multi-turn episodes (token in, token out), shared by engines, trainer and tasks.

An episode starts from a task's prompt. The policy samples a turn; the turn ends at EOS, at a stop string
(``Environment.stop_strings``) or at ``EpisodeLimits.max_turn_tokens``. The environment reads the turn's
text: no tool call ends the episode; a tool call pauses the row until the tools of every paused row have
run in one batched request (``Tools.run``), then the environment formats the observation, whose text is
tokenised segment by segment (``observation_tokens``) and appended to the row as it is. The policy's own
tokens are never re-tokenised: they stay the ids it sampled.

Every token after the prompt carries a role (``ROLE_*``): only actions have logprobs, ratios and gradient;
echo tokens are observation text the ECHO term may learn to predict; masked tokens are template text.
The trainer replays each recorded episode with its own tools (``stoa.episodes.replay``), so a worker cannot
inject observations. This module imports neither torch nor mlx.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import xxhash

from stoa.rollouts.episode import ROLE_ACTION, ROLE_ECHO, ROLE_MASKED, ToolCall

__all__ = [
    "Environment",
    "Observation",
    "TextEncoder",
    "action_runs",
    "episode_text",
    "ToolResult",
    "Tools",
    "ToolUnavailable",
    "observation_tokens",
    "result_hash",
]

@dataclass(frozen=True)
class ToolResult:
    """What a tool returned for one call."""

    text: str
    """The result as text the environment formats (for ``search``: the documents, already rendered)."""
    digest: str
    """``result_hash`` of the result's content (recorded, so a replay can name what differed)."""


@dataclass(frozen=True)
class Observation:
    """The environment's answer to a tool call, as text segments with their roles."""

    segments: tuple[tuple[str, int], ...]
    """(text, role) pieces in order; role ``ROLE_MASKED`` or ``ROLE_ECHO``. Each piece is tokenised on its
    own, so a role boundary is a token boundary on every machine."""
    state: str = ""
    """Key of the environment state after this observation: GiGPO's anchor states are the turns of a group
    that start from equal keys (empty: the state is the whole history, never shared)."""


class ToolUnavailable(RuntimeError):
    """The tools could not answer (e.g. the retriever endpoint is unreachable); no observation exists."""


@runtime_checkable
class Tools(Protocol):
    """Runs the tool calls of every paused row in one batched request."""

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """One result per call, in order.

        Raises:
            ToolUnavailable: nothing could be answered (the caller waits and retries; never a partial batch).
        """
        ...


@runtime_checkable
class Environment(Protocol):
    """One episode of one prompt and seed (built by the task: ``task.make_env(prompt, seed)``).

    The policy's turns may hold any text, observation markup included (``<information>`` written by the
    policy, not by ``observe``). Each task's reward states what such text is worth, and must never reward an
    answer for following a document the policy wrote itself: the search tasks score an episode whose own turns
    hold ``<information>`` or ``</information>`` 0 (``stoa.tasks.search.OBSERVATION_MARKUP``); the walk's reward
    replays the moves and never reads a ``<state>`` tag. Rewards read ``episode_text`` (the policy's turns
    only), never an observation.
    """

    stop_strings: tuple[str, ...]
    """Strings that end a model turn (e.g. ``</search>``, ``</answer>``). The engines pause a row at the first
    sampled token after which the decoded tail of its turn holds one; the trainer's replay rejects a recorded
    turn that holds one anywhere but at its end (``turn_end``)."""

    def initial_state(self) -> str:
        """Key of the state before the first turn (GiGPO's first anchor)."""
        ...

    def parse(self, turn_text: str) -> ToolCall | None:
        """The tool call a model turn makes; None ends the episode (a final answer or no call).

        Args:
            turn_text: the decoded text of the turn's sampled tokens.
        """
        ...

    def observe(self, call: ToolCall, result: ToolResult) -> Observation:
        """Advance the state with a call's result and format the observation the policy reads next.

        Args:
            call: the call ``parse`` returned.
            result: its result.
        """
        ...


class TextEncoder(Protocol):
    """What tokenising observations needs (``stoa.tokenize.TextCodec`` provides it)."""

    def encode_text(self, text: str) -> list[int]:
        """Token ids of plain text, without special tokens."""
        ...


def observation_tokens(obs: Observation, codec: TextEncoder) -> tuple[list[int], list[int]]:
    """The observation's token ids and their roles: each segment tokenised on its own, in order.

    Workers and the trainer's replay both call this, so an honest record's observation tokens equal the
    replay's exactly.

    Args:
        obs: the observation.
        codec: the run's tokenizer.
    """
    tokens: list[int] = []
    roles: list[int] = []
    for text, role in obs.segments:
        if role not in (ROLE_MASKED, ROLE_ECHO):
            raise ValueError(f"observation segment role {role}: must be ROLE_MASKED or ROLE_ECHO")
        ids = codec.encode_text(text) if text else []
        tokens += ids
        roles += [role] * len(ids)
    return tokens, roles


def result_hash(parts: Sequence[str]) -> str:
    """Hex digest (xxh3-64) of a tool result's content parts (e.g. document ids and texts).

    Args:
        parts: the strings that make up the result, in order.
    """
    h = xxhash.xxh3_64()
    for p in parts:
        b = p.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def action_runs(roles: Sequence[int]) -> list[tuple[int, int]]:
    """The model turns of an episode: ``(start, end)`` of each maximal run of ``ROLE_ACTION`` tokens.

    Args:
        roles: the role of every token after the prompt.
    """
    runs: list[tuple[int, int]] = []
    start = -1
    for i, r in enumerate(roles):
        if r == ROLE_ACTION and start < 0:
            start = i
        elif r != ROLE_ACTION and start >= 0:
            runs.append((start, i))
            start = -1
    if start >= 0:
        runs.append((start, len(roles)))
    return runs


def episode_text(tokens: Sequence[int], roles: Sequence[int], decode: Callable[[list[int]], str]) -> str:
    """What the policy wrote: each model turn decoded on its own, joined by newlines (observations excluded).

    Rewards read this (the answer is the last ``<answer>`` span the policy produced, never one in a prompt or
    an observation).

    Args:
        tokens: token ids after the prompt.
        roles: their roles.
        decode: token ids -> text (``TextCodec.decode``).
    """
    return "\n".join(decode([int(t) for t in tokens[a:b]]) for a, b in action_runs(roles))
