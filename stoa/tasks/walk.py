"""A small recurring-state toy environment for GiGPO: walk along a short line to a goal position.

The prompt gives the line (positions ``0 .. size-1``), the start and the goal. Each turn the model moves one
step with ``<move>left</move>`` or ``<move>right</move>`` (answered locally: ``tool_kind = "local"``) and reads
``<state>position N</state>``; a turn with ``<answer>...</answer>`` (or without a valid move) ends the episode.
The state key is the position itself, so the same states recur across the rows of a group and across turns:
GiGPO's anchor groups are non-trivial. Reward 1.0 when the episode ends with an answer at the goal.

Observation markup the policy writes itself (``<state>position N</state>`` in its own turn) earns nothing and
costs nothing: the reward replays the moves of the episode text (``WalkTask.final_position``) and never reads a
``<state>`` tag, so a position the policy claims is not where it stands.
"""

from __future__ import annotations

import hashlib
from typing import ClassVar

import numpy as np

from stoa.envs.base import Observation, ToolResult, Tools
from stoa.retrieval.base import Searcher
from stoa.rollouts.episode import ROLE_ECHO, ROLE_MASKED, ToolCall
from stoa.tasks.base import Prompt, chat_messages, check_prompt_version, format_prompt_id, parse_prompt_id
from stoa.tasks.demos import Demo
from stoa.tasks.multiturn import LIMIT_OPTIONS, LocalTools, limits_spec, task_limits
from stoa.tasks.qa import extract_final_answer

__all__ = ["MOVES", "WalkEnv", "WalkTask"]

MOVES = {"left": -1, "right": 1}
"""The move arguments and their steps."""

_OPEN, _CLOSE = "<move>", "</move>"
_SPLITS = ("train", "test")
_PROMPT_VERSION = 1
_MAX_SIZE = 20


def _key(position: int) -> str:
    return f"position {position}"


class WalkEnv:
    """One walk: the position moves with each valid ``<move>`` call, clamped to the line.

    Args:
        start: the start position.
        size: positions on the line.
    """

    stop_strings: tuple[str, ...] = ("</move>", "</answer>")

    def __init__(self, start: int, size: int) -> None:
        self.start, self.size, self.position = start, size, start

    def initial_state(self) -> str:
        """The start position's key."""
        return _key(self.start)

    def parse(self, turn_text: str) -> ToolCall | None:
        """The turn's move: None when it gives an ``<answer>`` or has no complete ``left``/``right`` move.

        Args:
            turn_text: the decoded turn (the argument is stripped and lowercased).
        """
        if "<answer>" in turn_text:
            return None
        end = turn_text.rfind(_CLOSE)
        start = turn_text.rfind(_OPEN, 0, end) if end >= 0 else -1
        if start < 0:
            return None
        arg = turn_text[start + len(_OPEN) : end].strip().lower()
        return ToolCall("move", arg) if arg in MOVES else None

    def observe(self, call: ToolCall, result: ToolResult) -> Observation:
        """Move by the result (the local tool returns the move) and show the position.

        Args:
            call: the move call.
            result: its result (text ``left`` or ``right``).
        """
        step = MOVES.get(result.text, 0)
        self.position = min(self.size - 1, max(0, self.position + step))
        segments = (("\n<state>", ROLE_MASKED), (_key(self.position), ROLE_ECHO), ("</state>\n", ROLE_MASKED))
        return Observation(segments=segments, state=_key(self.position))


class WalkTask:
    """Walk to the goal on a line of ``size`` positions; prompts are pure functions of ``(seed, id)``.

    Train and held-out prompts come from the same distribution (start != goal; there are only
    ``size * (size - 1)`` distinct problems): a toy for GiGPO, not a benchmark.

    Args:
        size: positions on the line (2 .. 20).
        seed: selects which problem each id maps to.
        max_turns: model turns per episode (the farthest goal needs ``size - 1`` moves and an answer).
        max_obs_tokens: tokens of one observation.
        max_total_tokens: tokens after the prompt.
        prompt_version: if given, must equal this code's prompt version (a check, from spec()).
    """

    id: str = "walk"
    reward_version: str = "1"
    tool_kind: str = "local"
    OPTIONS: ClassVar[dict[str, type]] = {"size": int, "seed": int, "prompt_version": int, **LIMIT_OPTIONS}

    def __init__(self, size: int = 5, seed: int = 0, max_turns: int = 8, max_obs_tokens: int = 32,
                 max_total_tokens: int = 512, prompt_version: int | None = None) -> None:
        check_prompt_version(self.id, prompt_version, _PROMPT_VERSION)
        if not 2 <= size <= _MAX_SIZE:
            raise ValueError(f"walk: option 'size' must be in [2, {_MAX_SIZE}], got {size}")
        if not 0 <= seed < 2**63:
            raise ValueError(f"walk: option 'seed' must be in [0, 2**63), got {seed}")
        self.size, self.seed = size, seed
        self.limits = task_limits(self.id, max_turns, max_obs_tokens, max_total_tokens)

    def spec(self) -> dict[str, object]:
        """JSON-able options that rebuild this task (``get_task("walk", **spec)``)."""
        return {"size": self.size, "seed": self.seed, "prompt_version": _PROMPT_VERSION, **limits_spec(self.limits)}

    def problem(self, prompt_id: str) -> tuple[int, int]:
        """The ``(start, goal)`` of a prompt id (start != goal).

        Args:
            prompt_id: "train:<i>" or "test:<i>".
        """
        split, index = parse_prompt_id(self.id, prompt_id, _SPLITS)
        d = hashlib.blake2b(f"stoa.walk|{self.seed}|{split}|{index}".encode(), digest_size=16).digest()
        start = int.from_bytes(d[:8], "little") % self.size
        goal = (start + 1 + int.from_bytes(d[8:], "little") % (self.size - 1)) % self.size
        return start, goal

    def get(self, prompt_id: str) -> Prompt:
        """The prompt with this id.

        Args:
            prompt_id: "train:<i>" or "test:<i>".

        Raises:
            PromptIdError: malformed id or unknown split.
        """
        start, goal = self.problem(prompt_id)
        text = (f"You are at position {start} on a line of positions 0 to {self.size - 1}. Reach position {goal}. "
                "Each turn, move one step with <move>left</move> or <move>right</move>; you will then see "
                f"<state>position N</state>. When you are at position {goal}, write <answer>done</answer>.")
        return Prompt(id=prompt_id, messages=chat_messages(text), answer=str(goal))

    def sample_train(self, rng: np.random.Generator) -> Prompt:
        """A random training prompt.

        Args:
            rng: source of the index.
        """
        return self.get(format_prompt_id("train", int(rng.integers(0, 2**62))))

    def heldout(self, n: int) -> list[Prompt]:
        """The first ``n`` held-out prompts.

        Args:
            n: how many.
        """
        if n < 0:
            raise ValueError(f"walk: heldout n must be >= 0, got {n}")
        return [self.get(format_prompt_id("test", i)) for i in range(n)]

    def demonstrations(self, n: int, rng: np.random.Generator) -> list[Demo]:
        """``n`` optimal episodes on random training prompts: one ``<move>`` per step toward the goal, then
        ``<answer>done</answer>``. The moves are answered locally; a walk longer than ``max_turns`` allows is
        dropped by the cold start (over the limits), which a line of ``size`` <= ``max_turns`` never needs.

        Args:
            n: how many.
            rng: source of the prompts.
        """
        out = []
        for _ in range(n):
            prompt = self.sample_train(rng)
            start, goal = self.problem(prompt.id)
            move = f"{_OPEN}{'right' if goal > start else 'left'}{_CLOSE}"
            out.append(Demo(prompt, (move,) * abs(goal - start) + ("<answer>done</answer>",)))
        return out

    def make_env(self, prompt: Prompt, seed: int) -> WalkEnv:
        """A walk from the prompt's start.

        Args:
            prompt: the prompt.
            seed: the episode's seed (unused: the walk is deterministic).
        """
        return WalkEnv(self.problem(prompt.id)[0], self.size)

    def make_tools(self, searcher: Searcher | None = None) -> Tools:
        """Local tools (each move's result is the move itself).

        Args:
            searcher: ignored (the walk needs no retriever).
        """
        return LocalTools()

    def final_position(self, prompt: Prompt, completion: str) -> int | None:
        """Where the episode ends, replaying its moves; None when a move was not executed or no answer ends it.

        The episode text is split at each ``</move>`` (a turn always ends at its first stop string, so every
        ``</move>`` closes one turn); each piece is parsed as the env does, and the text after the last one
        (the final turn) must hold an ``<answer>`` span.

        Args:
            prompt: the prompt.
            completion: the episode text (the policy's turns only).
        """
        env = self.make_env(prompt, 0)
        *moves, tail = completion.split(_CLOSE)
        tools = LocalTools()
        for piece in moves:
            call = env.parse(piece + _CLOSE)
            if call is None:
                return None
            env.observe(call, tools.run([call])[0])
        return env.position if extract_final_answer(tail) is not None else None

    def reward(self, prompt: Prompt, completion: str) -> float:
        """1.0 when the episode ends with an answer at the goal, else 0.0.

        Args:
            prompt: the prompt.
            completion: the episode text.
        """
        return 1.0 if self.final_position(prompt, completion) == self.problem(prompt.id)[1] else 0.0

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        """Whether the episode ends with an answer at the goal.

        Args:
            prompt: the prompt.
            completion: the episode text.
        """
        return self.reward(prompt, completion) == 1.0

    def __repr__(self) -> str:
        return f"WalkTask(size={self.size}, seed={self.seed})"
