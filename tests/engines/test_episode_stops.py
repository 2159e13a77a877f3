"""The driver's stop check decodes a turn's tail only after a token that can end a stop string, and pauses exactly
where decoding the tail after every token would (byte-level pieces, stop strings split across tokens)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from stoa.episodes.driver import EpisodeDriver, stop_last_chars, stop_window
from stoa.rollouts.episode import EpisodeLimits

from .test_episodes import FakeEnv, FakeTools

PIECES = [b"</", b"s", b">", b"a", b"</s>", b"x>", b"\xc3", b"\xa9", b" ", b"q", b"<", b"/", b"a>", b"\xc3\xa9>"]
"""Byte pieces (token id = index + 1; 0 is EOS): stop strings split across tokens, '>' inside longer pieces and
two-byte characters split in two."""


class ByteCodec:
    """Byte-level decoding as GPT-2-style tokenizers do it: join the pieces' bytes, decode with replacement.
    Counts the calls and the tokens decoded."""

    def __init__(self) -> None:
        self.calls = self.tokens = 0

    def encode_text(self, text: str) -> list[int]:
        return [PIECES.index(bytes([b])) + 1 for b in text.encode()]

    def decode(self, tokens: Sequence[int]) -> str:
        self.calls += 1
        self.tokens += len(tokens)
        return b"".join(PIECES[t - 1] for t in tokens if t).decode("utf-8", "replace")


def _first_stop(stream: Sequence[int], stops: Sequence[str]) -> int | None:
    """The index of the token after which a full tail decode first finds a stop string (the reference rule)."""
    window, codec = stop_window(stops), ByteCodec()
    for i in range(len(stream)):
        if any(s in codec.decode(stream[max(0, i + 1 - window):i + 1]) for s in stops):
            return i
    return None


def _pause_index(stream: Sequence[int]) -> int | None:
    driver = EpisodeDriver([FakeEnv()], FakeTools(), ByteCodec(), EpisodeLimits(max_turn_tokens=len(stream) + 1),
                           [0])
    for i, t in enumerate(stream):
        if not driver.record([0], [t], [0.0]):
            return i
    return None


def test_pauses_exactly_where_a_full_tail_decode_after_every_token_would():
    rng = random.Random(0)
    for _ in range(400):
        stream = [rng.randrange(1, len(PIECES) + 1) for _ in range(rng.randrange(1, 40))]
        assert _pause_index(stream) == _first_stop(stream, FakeEnv.stop_strings), stream


def test_a_turn_without_a_stop_strings_last_character_decodes_each_distinct_token_once():
    codec = ByteCodec()
    driver = EpisodeDriver([FakeEnv()], FakeTools(), codec, EpisodeLimits(max_turn_tokens=1000), [0])
    q, s, sp = (PIECES.index(p) + 1 for p in (b"q", b"s", b" "))
    for t in [q, s, sp] * 100:
        assert driver.record([0], [t], [0.0]) == [0]
    assert (codec.calls, codec.tokens) == (3, 3)  # a full tail check would decode 300 tails of up to 16 tokens
    assert driver.record([0], [PIECES.index(b"</s>") + 1], [0.0]) == []


def test_stop_strings_ending_in_a_space_or_non_ascii_are_decoded_after_every_token():
    assert stop_last_chars(("</s>", "</a>")) == frozenset(">")
    assert stop_last_chars(("</s>", "done ")) is None
    assert stop_last_chars(("</s>", "fini\u00e9")) is None

    class AccentEnv(FakeEnv):
        stop_strings: tuple[str, ...] = ("\u00e9",)

    codec = ByteCodec()
    driver = EpisodeDriver([AccentEnv()], FakeTools(), codec, EpisodeLimits(max_turn_tokens=10), [0])
    c3, a9 = PIECES.index(b"\xc3") + 1, PIECES.index(b"\xa9") + 1
    assert driver.record([0], [c3], [0.0]) == [0]
    assert driver.record([0], [a9], [0.0]) == []  # the second byte completes the character: the row pauses


def test_torch_episodes_are_the_same_tokens_and_logprobs_as_with_a_full_tail_decode_after_every_token(
        torch_engine, tiny_dir, monkeypatch):
    from stoa.tokenize import TextCodec

    from .test_torch_episodes import QUESTIONS, run

    codec = TextCodec(tiny_dir)
    fast, tools, _ = run(torch_engine, codec, QUESTIONS, 2, seed=4)
    monkeypatch.setattr(EpisodeDriver, "_may_stop", lambda self, r, token: True)
    full, full_tools, _ = run(torch_engine, codec, QUESTIONS, 2, seed=4)
    assert sum(len(e.calls) for g in fast for e in g) > 2  # several rows paused and resumed
    assert tools.batches == full_tools.batches
    for ga, gb in zip(fast, full, strict=True):
        for a, b in zip(ga, gb, strict=True):
            assert (a.tokens, a.logprobs, a.roles, a.turn_starts, a.end_reason) == (
                b.tokens, b.logprobs, b.roles, b.turn_starts, b.end_reason)
