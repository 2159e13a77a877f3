"""Fakes for replay tests: a search-shaped environment, tools that count their batches, a char-level codec,
and a tiny driver that records honest samples the way the engines' ``EpisodeDriver`` does."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from stoa.envs import Observation, ToolResult, ToolUnavailable, observation_tokens, result_hash
from stoa.rollouts.episode import ROLE_ACTION, ROLE_ECHO, ROLE_MASKED, ToolCall
from stoa.rollouts.records import Sample

_SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)


class SearchEnv:
    """The Search-R1 shape: ``<search>q</search>`` calls, ``<answer>`` ends, documents as echo tokens."""

    stop_strings: tuple[str, ...] = ("</search>", "</answer>")

    def __init__(self, seed: int = 0):
        self.state = f"seed{seed}"

    def initial_state(self) -> str:
        return self.state

    def parse(self, turn_text: str) -> ToolCall | None:
        if "<answer>" in turn_text:
            return None
        found = _SEARCH.findall(turn_text)
        return ToolCall("search", found[-1].strip()) if found else None

    def observe(self, call: ToolCall, result: ToolResult) -> Observation:
        self.state = result_hash([self.state, result.digest])
        return Observation((("\n<information>", ROLE_MASKED), (result.text, ROLE_ECHO),
                            ("</information>\n", ROLE_MASKED)), self.state)


@dataclass
class FakeTools:
    """Answers ``search`` calls from a dict; records every batch; ``fail`` raises ``ToolUnavailable``."""

    docs: dict[str, str] = field(default_factory=lambda: {"capital of x": "X city is the capital.",
                                                          "color of y": "Y is blue."})
    fail: bool = False
    batches: list[list[ToolCall]] = field(default_factory=list)

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        if self.fail:
            raise ToolUnavailable("retriever down")
        self.batches.append(list(calls))
        texts = [self.docs.get(c.arguments, "no result") for c in calls]
        return [ToolResult(t, result_hash([c.name, c.arguments, t])) for c, t in zip(calls, texts, strict=True)]


class CharCodec:
    """One token per character (ids are code points)."""

    def encode_text(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, tokens: Sequence[int]) -> str:
        return "".join(chr(t) for t in tokens)


def honest_sample(turns: Sequence[str], codec, tools=None, *, seed: int = 0, reward: float = 0.0,
                  end: str = "stop", lp: float = -0.5, env=None) -> Sample:
    """A sample recorded as the engines' driver records it: each turn's tokens, then its observation.

    ``env`` defaults to this module's ``SearchEnv(seed)``; any ``Environment`` (a real task's) works.
    """
    env, tools = env or SearchEnv(seed), tools or FakeTools()
    tokens: list[int] = []
    roles: list[int] = []
    starts: list[int] = []
    calls: list[ToolCall] = []
    digests: list[str] = []
    for k, text in enumerate(turns):
        starts.append(len(tokens))
        ids = codec.encode_text(text)
        tokens += ids
        roles += [ROLE_ACTION] * len(ids)
        call = env.parse(codec.decode(ids))
        if call is None or k == len(turns) - 1:
            break
        result = tools.run([call])[0]
        obs_ids, obs_roles = observation_tokens(env.observe(call, result), codec)
        tokens += obs_ids
        roles += obs_roles
        calls.append(call)
        digests.append(result.digest)
    roles_a = np.array(roles, np.uint8)
    logprobs = np.where(roles_a == ROLE_ACTION, lp, 0.0).astype(np.float32)
    return Sample(np.array(tokens, np.int32), logprobs, reward, "length" if end == "length" else "stop",
                  roles=roles_a, turn_starts=starts, calls=calls, digests=digests, end_reason=end)
