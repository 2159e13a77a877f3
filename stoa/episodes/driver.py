"""Multi-turn episodes of a batch of rows, engine-agnostic: what each row sampled, when it pauses, resumes or ends.

An engine samples every decoding row one token at a time and hands the tokens to ``EpisodeDriver.record``,
which says which rows go on. A row ends at EOS (``stop``), when its turn reaches ``max_turn_tokens``
(``length``) or when its episode reaches ``max_total_tokens``; it PAUSES when the text of its current turn
contains one of its environment's stop strings. When no row decodes, the engine calls ``resume``: every
paused row's turn is parsed, the calls of all of them run in one ``Tools.run`` request, and the rows that
go on get their observation tokens (the engine feeds them, after the row's last sampled token, into the
row's own cache). Row ``g * n + j`` is sample ``j`` of prompt ``g`` (as ``stoa.engines.base.RowLog``). The
trainer's replay (``stoa.episodes.replay``) ends turns by the same rule (``stop_window``).

This module imports neither torch nor mlx.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from stoa.envs.base import Environment, Tools, observation_tokens
from stoa.rollouts.episode import ROLE_ACTION, EpisodeLimits, ToolCall

__all__ = ["Episode", "EpisodeCodec", "EpisodeDriver", "stop_window"]

#: Fewest trailing tokens of a turn decoded to look for a stop string after each sampled token.
TAIL_TOKENS = 16

_DECODING, _PAUSED, _ENDED = "decoding", "paused", "ended"


class EpisodeCodec(Protocol):
    """What the driver needs of the run's tokenizer (``stoa.tokenize.TextCodec`` provides it)."""

    def encode_text(self, text: str) -> list[int]:
        """Token ids of plain text, without special tokens."""
        ...

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of token ids, without special tokens."""
        ...


@dataclass
class Episode:
    """One row's episode: every token after the prompt with its role, and what the turns did."""

    tokens: list[int] = field(default_factory=list)
    """Every token after the prompt (actions and observations)."""
    logprobs: list[float] = field(default_factory=list)
    """Behaviour logprob on ``ROLE_ACTION`` tokens, 0.0 elsewhere."""
    roles: list[int] = field(default_factory=list)
    """``ROLE_*`` of each token."""
    turn_starts: list[int] = field(default_factory=list)
    """Index in ``tokens`` of each model turn's first token."""
    calls: list[ToolCall] = field(default_factory=list)
    """The tool calls made, in order (one per observation)."""
    digests: list[str] = field(default_factory=list)
    """``ToolResult.digest`` of each call."""
    states: list[str] = field(default_factory=list)
    """Anchor-state key at the start of each model turn: ``env.initial_state()``, then each observation's."""
    end_reason: str = ""
    """One of ``stoa.rollouts.episode.END_REASONS`` (empty while the episode runs)."""

    @property
    def finish_reason(self) -> str:
        """The version-1 record field: ``length`` if the last turn hit its cap, else ``stop``."""
        return "length" if self.end_reason == "length" else "stop"


@dataclass
class _Row:
    """A row's episode and where it stands."""

    episode: Episode
    env: Environment
    status: str = _DECODING
    turn_len: int = 0
    call: ToolCall | None = None


@dataclass
class _Decision:
    """What ``resume`` decided for one paused row before any tool ran."""

    row: int
    call: ToolCall | None
    end: str = ""


class EpisodeDriver:
    """Drives the episodes of one batch: records sampled tokens, pauses rows at stop strings, runs tools.

    Args:
        envs: one environment per row (row ``g * n + j``: sample ``j`` of prompt ``g``).
        tools: runs the calls of all paused rows in one request.
        codec: the run's tokenizer (``encode_text`` for observations, ``decode`` for turns).
        limits: the episode limits (turns, turn tokens, observation tokens, total tokens).
        eos_ids: tokens that end an episode (kept in it).
    """

    def __init__(self, envs: Sequence[Environment], tools: Tools, codec: EpisodeCodec, limits: EpisodeLimits,
                 eos_ids: Sequence[int]):
        if not envs:
            raise ValueError("envs: the driver needs one environment per row, got none")
        self.tools, self.codec, self.limits = tools, codec, limits
        self.eos = frozenset(int(t) for t in eos_ids)
        self._rows = [_Row(Episode(states=[env.initial_state()]), env) for env in envs]
        self._tail = {i: stop_window(env.stop_strings) for i, env in enumerate(envs)}
        self._last_chars = {i: stop_last_chars(env.stop_strings) for i, env in enumerate(envs)}
        self._pieces: dict[int, str] = {}
        """Token id -> its text decoded alone (``_may_stop``)."""
        self.stats: dict[str, float] = {"turns": 0.0, "tool_calls": 0.0, "tool_requests": 0.0, "tool_seconds": 0.0,
                                        "obs_tokens": 0.0}
        """Turns begun, tool calls made, ``Tools.run`` requests that held them, their seconds, observation tokens."""

    @property
    def rows(self) -> int:
        """Rows of the batch (prompts x samples)."""
        return len(self._rows)

    def episode(self, row: int) -> Episode:
        """A row's episode so far (ended or not).

        Args:
            row: the row number.
        """
        return self._rows[row].episode

    @property
    def paused(self) -> list[int]:
        """Rows waiting for an observation, in row order."""
        return [i for i, r in enumerate(self._rows) if r.status == _PAUSED]

    @property
    def decoding(self) -> list[int]:
        """Rows sampling their current turn, in row order."""
        return [i for i, r in enumerate(self._rows) if r.status == _DECODING]

    @property
    def done(self) -> bool:
        """True when every episode has ended."""
        return all(r.status == _ENDED for r in self._rows)

    def record(self, active: Sequence[int], tokens: Sequence[int], logprobs: Sequence[float]) -> list[int]:
        """Append one sampled token (an action) to each active row and decide whether the row goes on.

        Args:
            active: the row numbers sampled this step, in batch order (each must be decoding).
            tokens: the token sampled for each of them.
            logprobs: its behaviour logprob.

        Returns:
            the batch positions (indices into ``active``) of the rows that keep decoding this turn; the
            others have ended or paused.
        """
        keep: list[int] = []
        for i, (r, t, v) in enumerate(zip(active, tokens, logprobs, strict=True)):
            row = self._rows[r]
            if row.status != _DECODING:
                raise ValueError(f"active row {r}: it is {row.status}, not decoding; drop it from the batch")
            ep = row.episode
            if row.turn_len == 0:
                ep.turn_starts.append(len(ep.tokens))
                self.stats["turns"] += 1
            ep.tokens.append(int(t))
            ep.logprobs.append(float(v))
            ep.roles.append(ROLE_ACTION)
            row.turn_len += 1
            self._after_token(r, row)
            if row.status == _DECODING:
                keep.append(i)
        return keep

    def _after_token(self, r: int, row: _Row) -> None:
        """End or pause a row after its newest token (EOS, stop string, turn cap, total budget)."""
        ep = row.episode
        if ep.tokens[-1] in self.eos:
            self._end(row, "stop")
        elif self._stopped(r, row):
            row.status = _PAUSED
        elif row.turn_len >= self.limits.max_turn_tokens:
            self._end(row, "length")
        elif len(ep.tokens) >= self.limits.max_total_tokens:
            self._end(row, "max_total_tokens")

    def _stopped(self, r: int, row: _Row) -> bool:
        """True when the tail of the row's current turn contains one of its environment's stop strings."""
        stops = row.env.stop_strings
        if not stops or not self._may_stop(r, row.episode.tokens[-1]):
            return False
        n = min(row.turn_len, self._tail[r])
        text = self.codec.decode(row.episode.tokens[-n:])
        return any(s in text for s in stops)

    def _may_stop(self, r: int, token: int) -> bool:
        """False when the newest token cannot have completed a stop string, so the tail need not be decoded.

        The tail was checked after the turn's previous token, so a new match ends in the newest token's text.
        When every stop string ends in an ASCII non-space character (``stop_last_chars``), that character is in
        the token's own text: an ASCII byte never joins a neighbour's bytes into one character.
        """
        ends = self._last_chars[r]
        if ends is None:
            return True
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self.codec.decode([token])
        return any(c in piece for c in ends)

    @staticmethod
    def _end(row: _Row, reason: str) -> None:
        row.status, row.episode.end_reason, row.call = _ENDED, reason, None

    def _decide(self, r: int) -> _Decision:
        """Parse a paused row's turn (once) and decide whether it ends before any tool runs."""
        row = self._rows[r]
        ep = row.episode
        if row.call is None:
            row.call = row.env.parse(self.codec.decode(ep.tokens[ep.turn_starts[-1]:]))
        if row.call is None:
            return _Decision(r, None, "stop")
        if len(ep.turn_starts) >= self.limits.max_turns:
            return _Decision(r, row.call, "max_turns")
        return _Decision(r, row.call)

    def resume(self) -> dict[int, list[int]]:
        """Run the tools of all paused rows in one ``Tools.run`` request and append their observations.

        Returns:
            row -> the observation tokens to feed it (after its last sampled token), for the rows that go
            on; every other paused row has ended (``stop``, ``max_turns``, ``max_obs_tokens`` or
            ``max_total_tokens``).

        Raises:
            ToolUnavailable: the tools could not answer; every row stays paused (call ``resume`` again).
            ValueError: the tools returned a number of results other than the number of calls.
        """
        decisions = [self._decide(r) for r in self.paused]
        todo = [d for d in decisions if not d.end]
        results = []
        if todo:
            calls = [d.call for d in todo if d.call is not None]
            t0 = time.perf_counter()
            results = self.tools.run(calls)
            self.stats["tool_seconds"] += time.perf_counter() - t0
            if len(results) != len(calls):
                raise ValueError(f"tools.run: returned {len(results)} results for {len(calls)} calls; "
                                 "a Tools must answer every call in order")
            self.stats["tool_calls"] += len(calls)
            self.stats["tool_requests"] += 1
        for d in decisions:
            if d.end:
                self._end(self._rows[d.row], d.end)
        fed: dict[int, list[int]] = {}
        for d, result in zip(todo, results, strict=True):
            row = self._rows[d.row]
            assert d.call is not None
            obs = row.env.observe(d.call, result)
            toks, roles = observation_tokens(obs, self.codec)
            ep = row.episode
            if len(toks) > self.limits.max_obs_tokens:
                self._end(row, "max_obs_tokens")
            elif len(ep.tokens) + len(toks) >= self.limits.max_total_tokens:  # no room left for a turn
                self._end(row, "max_total_tokens")
            else:
                ep.tokens += toks
                ep.roles += roles
                ep.logprobs += [0.0] * len(toks)
                ep.calls.append(d.call)
                ep.digests.append(result.digest)
                ep.states.append(obs.state)
                row.status, row.turn_len, row.call = _DECODING, 0, None
                self.stats["obs_tokens"] += len(toks)
                fed[d.row] = toks
        return fed

    def episodes(self, n: int) -> list[list[Episode]]:
        """The finished episodes, ``n`` per prompt, in prompt order.

        Args:
            n: samples per prompt.

        Raises:
            ValueError: an episode has not ended, or ``n`` does not divide the rows.
        """
        if n < 1 or self.rows % n:
            raise ValueError(f"n={n}: must divide the driver's {self.rows} rows")
        live = [i for i, r in enumerate(self._rows) if r.status != _ENDED]
        if live:
            raise ValueError(f"rows {live[:5]} have not ended; decode and resume until driver.done")
        eps = [r.episode for r in self._rows]
        return [eps[g * n:(g + 1) * n] for g in range(self.rows // n)]


def stop_last_chars(stop_strings: Sequence[str]) -> frozenset[str] | None:
    """The last characters of the stop strings when every one is ASCII and not a space (the driver then decodes a
    turn's tail only after a token whose own text holds one of them); None otherwise (decode after every token)."""
    ends = frozenset(s[-1] for s in stop_strings if s)
    if any(not s or not s[-1].isascii() or s[-1].isspace() for s in stop_strings):
        return None
    return ends


def stop_window(stop_strings: Sequence[str]) -> int:
    """Trailing tokens enough to hold any of the stop strings (a token holds at least one byte)."""
    longest = max((len(s.encode("utf-8")) for s in stop_strings), default=0)
    return max(TAIL_TOKENS, longest + 2)
