"""The trainer's replay of recorded episodes: every observation a worker recorded is re-derived, not trusted.

A record's sample is a token sequence with roles (``stoa.envs.ROLE_*``): runs of action tokens (the model's
turns) separated by observation runs. ``replay_group`` re-parses every turn that an observation follows
with the sample's own environment, checks the call equals the recorded one, runs ALL calls of the group in
one ``Tools.run`` (the trainer's own tools: its retriever), rebuilds each observation with ``env.observe``
and ``observation_tokens`` and demands token-for-token and role-for-role equality. A worker therefore
cannot inject a document the retriever never returned, nor relabel observation tokens as actions.

The last turn, when no observation follows it, ended the episode and is not parsed (its end reason is the
worker's to report; a false one only costs the worker its own sample). This module imports neither torch
nor mlx.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from stoa.envs.base import (
    Environment,
    EpisodeLimits,
    ToolResult,
    Tools,
    action_runs,
    episode_text,
    observation_tokens,
)
from stoa.records import RecordRejected, Sample, check_episode

__all__ = ["ReplayCodec", "Replayed", "replay_group"]


class ReplayCodec(Protocol):
    """What replay needs of the tokenizer (``stoa.tokenize.TextCodec`` provides it)."""

    def encode_text(self, text: str) -> list[int]:
        """Token ids of plain text, without special tokens."""
        ...

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of token ids, without special tokens."""
        ...


@dataclass(frozen=True)
class Replayed:
    """What the trainer learned by replaying one sample (kept on the pool's entry for the step)."""

    text: str
    """``episode_text`` of the sample: the model's turns, decoded each on its own (what the reward reads)."""
    turn_of_token: np.ndarray
    """int32 [T]: the model turn index of each action token, -1 on observation tokens."""
    states: tuple[str, ...]
    """Anchor-state key at the start of each model turn: ``env.initial_state()``, then each observation's
    ``state`` (as ``Episode.states``)."""
    calls: int
    """Tool calls replayed for this sample."""


def replay_group(envs: Sequence[Environment], samples: Sequence[Sample], tools: Tools, codec: ReplayCodec,
                 limits: EpisodeLimits) -> list[Replayed]:
    """Replay a record's samples with the trainer's tools; one ``Replayed`` per sample, in order.

    Args:
        envs: one fresh environment per sample (``task.make_env(prompt, record.env_seed)``).
        samples: the record's samples.
        tools: the trainer's own tools; every call of the group goes to one ``tools.run``.
        codec: the run's tokenizer.
        limits: the task's episode limits.

    Raises:
        RecordRejected: ``roles`` or ``limits`` (the sample's structure, see ``check_episode``), or
            ``observation`` naming the sample and turn whose call, result digest or observation tokens
            differ from the replay.
        ToolUnavailable: the trainer's tools could not answer; the record is not at fault (retry later).
    """
    if len(envs) != len(samples):
        raise ValueError(f"envs: {len(envs)} environments for {len(samples)} samples; pass one per sample")
    for i, s in enumerate(samples):
        check_episode(s, i, limits)
    calls = [c for s in samples for c in s.calls]
    results = tools.run(calls) if calls else []
    if len(results) != len(calls):
        raise RuntimeError(f"tools returned {len(results)} results for {len(calls)} calls; Tools.run must "
                           "answer every call or raise ToolUnavailable")
    out, k = [], 0
    for i, (env, s) in enumerate(zip(envs, samples, strict=True)):
        out.append(_replay_sample(i, env, s, results[k : k + len(s.calls)], codec))
        k += len(s.calls)
    return out


def _replay_sample(index: int, env: Environment, s: Sample, results: Sequence[ToolResult],
                   codec: ReplayCodec) -> Replayed:
    """Replay one structurally valid sample against its tool results; raises ``RecordRejected``."""
    tokens, roles = [int(t) for t in s.tokens], [int(r) for r in s.role_array()]
    turns = action_runs(roles)
    turn_of_token = np.full(len(tokens), -1, np.int32)
    states = [env.initial_state()]
    for k, (a, b) in enumerate(turns):
        turn_of_token[a:b] = k
        if k >= len(s.calls):
            continue  # the final turn: no observation follows it
        where = f"sample {index} turn {k}"
        call = env.parse(codec.decode(tokens[a:b]))
        if call is None or call != s.calls[k]:
            raise RecordRejected("observation", f"{where}: the turn parses to {call!r}, the record says "
                                                f"{s.calls[k]!r}")
        if results[k].digest != s.digests[k]:
            raise RecordRejected("observation", f"{where}: result digest {s.digests[k]!r} != the trainer's "
                                                f"{results[k].digest!r}")
        obs = env.observe(call, results[k])
        want_tokens, want_roles = observation_tokens(obs, codec)
        end = turns[k + 1][0] if k + 1 < len(turns) else len(tokens)
        if tokens[b:end] != want_tokens or roles[b:end] != want_roles:
            raise RecordRejected("observation", f"{where}: the recorded observation ({end - b} tokens) differs "
                                                f"from the replayed one ({len(want_tokens)} tokens)")
        states.append(obs.state)
    return Replayed(episode_text(tokens, roles, codec.decode), turn_of_token, tuple(states[: len(turns)]),
                    len(s.calls))
