"""The trainer's replay of recorded episodes: every observation a worker recorded is re-derived, not trusted.

A record's sample is a token sequence with roles (``stoa.rollouts.episode.ROLE_*``): runs of action tokens (the model's
turns) separated by observation runs. ``replay_group`` re-parses every turn that an observation follows
with the sample's own environment, checks the call equals the recorded one, runs ALL calls of the group in
one ``Tools.run`` (the trainer's own tools: its retriever), rebuilds each observation with ``env.observe``
and ``observation_tokens`` and demands token-for-token and role-for-role equality. A worker therefore
cannot inject a document the retriever never returned, nor relabel observation tokens as actions.

Every turn must also end exactly where the ``EpisodeDriver`` (``stoa.episodes.driver``) would have ended
it (reason ``turn_end``): after each action token the driver decodes the turn's last ``stop_window`` tokens and pauses
the row when that text holds one of the environment's stop strings, so no earlier token of a turn may
complete a stop string, nor be an EOS token. A turn that an observation follows must end at a stop string;
the last turn must end at EOS, at a stop string, at ``max_turn_tokens`` or at ``max_total_tokens``, and its
end reason must be the one the driver would have given. A worker therefore cannot claim text past a
``</search>`` (a forged document, an answer) as the model's own turn. This module imports neither torch
nor mlx.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from stoa.envs.base import Environment, ToolResult, Tools, action_runs, episode_text, observation_tokens
from stoa.episodes.driver import stop_window  # the driver's own window, so both agree
from stoa.rollouts.episode import EpisodeLimits
from stoa.rollouts.records import RecordRejected, Sample, check_episode

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
                 limits: EpisodeLimits, eos_ids: Sequence[int] = ()) -> list[Replayed]:
    """Replay a record's samples with the trainer's tools; one ``Replayed`` per sample, in order.

    Args:
        envs: one fresh environment per sample (``task.make_env(prompt, record.env_seed)``).
        samples: the record's samples.
        tools: the trainer's own tools; every call of the group goes to one ``tools.run``.
        codec: the run's tokenizer.
        limits: the task's episode limits.
        eos_ids: the tokens that end an episode (the engines' ``codec.eos_ids``).

    Raises:
        RecordRejected: ``roles`` or ``limits`` (the sample's structure, see ``check_episode``),
            ``turn_end`` naming the sample and turn that does not end where an engine would have ended it, or
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
        out.append(_replay_sample(i, env, s, results[k : k + len(s.calls)], codec, _Ender.of(env, limits, eos_ids)))
        k += len(s.calls)
    return out


def unreplayed(samples: Sequence[Sample], codec: ReplayCodec, limits: EpisodeLimits) -> list[Replayed]:
    """A record's samples taken as recorded, without re-running a tool (``replay = false``): the structure is
    checked, the observations are the worker's word. No anchor states (GiGPO's are the replayed ones).

    Args:
        samples: the record's samples.
        codec: the run's tokenizer.
        limits: the task's episode limits.

    Raises:
        RecordRejected: ``roles`` or ``limits`` (``check_episode``).
    """
    out = []
    for i, s in enumerate(samples):
        check_episode(s, i, limits)
        tokens, roles = [int(t) for t in s.tokens], [int(r) for r in s.role_array()]
        turn_of_token = np.full(len(tokens), -1, np.int32)
        turns = action_runs(roles)
        for k, (a, b) in enumerate(turns):
            turn_of_token[a:b] = k
        out.append(Replayed(episode_text(tokens, roles, codec.decode), turn_of_token, ("",) * len(turns), 0))
    return out


def _replay_sample(index: int, env: Environment, s: Sample, results: Sequence[ToolResult],
                   codec: ReplayCodec, ender: _Ender) -> Replayed:
    """Replay one structurally valid sample against its tool results; raises ``RecordRejected``."""
    tokens, roles = [int(t) for t in s.tokens], [int(r) for r in s.role_array()]
    turns = action_runs(roles)
    if len(s.calls) >= len(turns):
        raise RecordRejected("turn_end", f"sample {index}: it ends with an observation; an engine samples a turn "
                                         "after every observation")
    turn_of_token = np.full(len(tokens), -1, np.int32)
    states = [env.initial_state()]
    for k, (a, b) in enumerate(turns):
        turn_of_token[a:b] = k
        where = f"sample {index} turn {k}"
        ender.check_inside(where, tokens, a, b, codec)
        if k >= len(s.calls):  # the final turn: no observation follows it
            ender.check_final(where, env, s.end_reason, tokens, a, b, len(turns), codec)
            continue
        if tokens[b - 1] in ender.eos or not ender.stopped(tokens, a, b, codec):
            raise RecordRejected("turn_end", f"{where}: an observation follows a turn that does not end at a "
                                             f"stop string {ender.stops}")
        call = env.parse(codec.decode(tokens[a:b]))
        if call is None or call != s.calls[k]:
            raise RecordRejected("observation", f"{where}: the turn parses to {call!r}, the record says "
                                                f"{s.calls[k]!r}")
        if results[k].digest != s.digests[k]:
            raise RecordRejected("observation", f"{where}: result digest {s.digests[k]!r} != the trainer's "
                                                f"{results[k].digest!r}")
        obs = env.observe(call, results[k])
        want_tokens, want_roles = observation_tokens(obs, codec)
        end = turns[k + 1][0]
        if tokens[b:end] != want_tokens or roles[b:end] != want_roles:
            raise RecordRejected("observation", f"{where}: the recorded observation ({end - b} tokens) differs "
                                                f"from the replayed one ({len(want_tokens)} tokens)")
        states.append(obs.state)
    return Replayed(episode_text(tokens, roles, codec.decode), turn_of_token, tuple(states[: len(turns)]),
                    len(s.calls))


@dataclass(frozen=True)
class _Ender:
    """Where the ``EpisodeDriver`` ends a turn: its stop strings, decode window, EOS ids and limits."""

    stops: tuple[str, ...]
    window: int
    eos: frozenset[int]
    limits: EpisodeLimits

    @classmethod
    def of(cls, env: Environment, limits: EpisodeLimits, eos_ids: Sequence[int]) -> _Ender:
        """The rule of one environment (``stop_window`` is the driver's own)."""
        stops = tuple(env.stop_strings)
        return cls(stops, stop_window(stops), frozenset(int(t) for t in eos_ids), limits)

    def stopped(self, tokens: Sequence[int], a: int, j: int, codec: ReplayCodec) -> bool:
        """Whether the driver pauses a turn that starts at ``a`` once token ``j - 1`` is sampled: the decoded
        text of the turn's last ``window`` tokens holds a stop string."""
        if not self.stops:
            return False
        text = codec.decode(tokens[max(a, j - self.window) : j])
        return any(x in text for x in self.stops)

    def check_inside(self, where: str, tokens: Sequence[int], a: int, b: int, codec: ReplayCodec) -> None:
        """Reject a turn ``[a, b)`` that an engine would have ended before its last token (EOS or a stop string)."""
        for j in range(a + 1, b):
            if tokens[j - 1] in self.eos:
                raise RecordRejected("turn_end", f"{where}: EOS at token {j - 1 - a} of {b - a} ends the episode "
                                                 "there, yet the turn goes on")
            if self.stopped(tokens, a, j, codec):
                raise RecordRejected("turn_end", f"{where}: a stop string {self.stops} completes at token "
                                                 f"{j - 1 - a} of {b - a}; the turn must end there")

    def check_final(self, where: str, env: Environment, end_reason: str, tokens: Sequence[int], a: int, b: int,
                    turns: int, codec: ReplayCodec) -> None:
        """Reject a last turn ``[a, b)`` that no engine would have ended there with the recorded end reason."""
        if tokens[b - 1] in self.eos:
            allowed: tuple[str, ...] = ("stop",)
        elif self.stopped(tokens, a, b, codec):
            if env.parse(codec.decode(tokens[a:b])) is None:
                allowed = ("stop",)
            elif turns >= self.limits.max_turns:
                allowed = ("max_turns",)
            else:  # the observation was too long, or left no room for a turn
                allowed = ("max_obs_tokens", "max_total_tokens")
        elif b - a >= self.limits.max_turn_tokens:
            allowed = ("length",)
        elif b >= self.limits.max_total_tokens:
            allowed = ("max_total_tokens",)
        else:
            raise RecordRejected("turn_end", f"{where}: the episode ends after {b - a} tokens without EOS, a stop "
                                             f"string {self.stops} or a limit")
        if end_reason not in allowed:
            raise RecordRejected("turn_end", f"{where}: end reason {end_reason!r}; an engine ending the turn "
                                             f"there gives {' or '.join(allowed)}")
