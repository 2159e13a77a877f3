"""EpisodeDriver on a character-level codec and scripted turns: pauses, tool batching, every end reason."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from stoa.envs.base import Observation, ToolResult, ToolUnavailable
from stoa.episodes.driver import Episode, EpisodeDriver
from stoa.rollouts.episode import END_REASONS, ROLE_ACTION, ROLE_ECHO, ROLE_MASKED, EpisodeLimits, ToolCall

EOS = 0


class CharCodec:
    """One token per character (id = code point); token 0 is EOS and decodes to nothing."""

    def encode_text(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, tokens: Sequence[int]) -> str:
        return "".join(chr(t) for t in tokens if t != EOS)


class FakeEnv:
    """``<s>q</s>`` searches q; a turn with ``<a>`` answers (ends); observations ``[`` result ``]``."""

    stop_strings: tuple[str, ...] = ("</s>", "</a>")

    def __init__(self, name: str = "e"):
        self.state = f"{name}0"

    def initial_state(self) -> str:
        return self.state

    def parse(self, turn_text: str) -> ToolCall | None:
        if "<a>" in turn_text or "<s>" not in turn_text:
            return None
        return ToolCall("search", turn_text.rsplit("<s>", 1)[1].split("</s>")[0])

    def observe(self, call: ToolCall, result: ToolResult) -> Observation:
        self.state = f"{self.state}|{result.digest}"
        return Observation(segments=(("[", ROLE_MASKED), (result.text, ROLE_ECHO), ("]", ROLE_MASKED)),
                          state=self.state)


class FakeTools:
    """Answers ``R<query>``; records every batch; may fail its first ``fail`` requests."""

    def __init__(self, fail: int = 0, long: int = 0):
        self.batches: list[list[ToolCall]] = []
        self.fail, self.long = fail, long

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        self.batches.append(list(calls))
        if self.fail:
            self.fail -= 1
            raise ToolUnavailable("retriever down")
        return [ToolResult("R" + c.arguments + "x" * self.long, "d" + c.arguments) for c in calls]


def drive(driver: EpisodeDriver, scripts: dict[int, list[str]]) -> None:
    """A fake engine: each decoding row samples the next character of its current turn's script
    (``\\0`` = EOS; past the script it samples ``z``); resume when no row decodes."""
    turn = dict.fromkeys(scripts, 0)
    pos = dict.fromkeys(scripts, 0)
    for _ in range(1000):
        if driver.done:
            return
        active = driver.decoding
        if not active:
            for r in driver.resume():
                turn[r], pos[r] = turn[r] + 1, 0
            continue
        toks = []
        for r in active:
            text = scripts[r][turn[r]] if turn[r] < len(scripts[r]) else ""
            toks.append(ord(text[pos[r]]) if pos[r] < len(text) else ord("z"))
            pos[r] += 1
        driver.record(active, toks, [-0.5] * len(active))
    raise AssertionError("the episodes never ended")


def make(rows: int, tools: FakeTools | None = None, **limits: int) -> tuple[EpisodeDriver, FakeTools]:
    tools = tools or FakeTools()
    envs = [FakeEnv(f"e{i}") for i in range(rows)]
    return EpisodeDriver(envs, tools, CharCodec(), EpisodeLimits(**limits), [EOS]), tools


def test_eos_ends_the_episode_with_stop_and_every_token_is_an_action():
    driver, tools = make(1)
    drive(driver, {0: ["ab\0"]})
    (ep,), = driver.episodes(1)
    assert ep.tokens == [ord("a"), ord("b"), EOS]
    assert ep.roles == [ROLE_ACTION] * 3 and ep.logprobs == [-0.5] * 3
    assert ep.end_reason == "stop" and ep.finish_reason == "stop"
    assert ep.turn_starts == [0] and ep.states == ["e00"] and ep.calls == [] and tools.batches == []


def test_a_tool_call_pauses_the_row_and_its_observation_is_appended_with_roles_and_zero_logprobs():
    driver, tools = make(1)
    turn1, turn2 = "x<s>q1</s>", "<a>42</a>"
    drive(driver, {0: [turn1, turn2]})
    (ep,), = driver.episodes(1)
    obs = "[Rq1]"
    assert CharCodec().decode(ep.tokens) == turn1 + obs + turn2
    assert ep.roles == [1] * len(turn1) + [0, 2, 2, 2, 0] + [1] * len(turn2)
    assert ep.logprobs == [-0.5] * len(turn1) + [0.0] * len(obs) + [-0.5] * len(turn2)
    assert ep.turn_starts == [0, len(turn1) + len(obs)]
    assert ep.calls == [ToolCall("search", "q1")] and ep.digests == ["dq1"]
    assert ep.states == ["e00", "e00|dq1"]
    assert ep.end_reason == "stop"  # the answer turn paused at </a>, parse -> None
    assert tools.batches == [[ToolCall("search", "q1")]]
    assert driver.stats == {"turns": 2.0, "tool_calls": 1.0, "tool_requests": 1.0, "tool_seconds": pytest.approx(
        driver.stats["tool_seconds"]), "obs_tokens": 5.0}


def test_all_paused_rows_calls_go_in_one_request_and_rows_finish_independently():
    driver, tools = make(3)
    scripts = {0: ["<s>a</s>", "<a>1</a>"], 1: ["\0"], 2: ["long text <s>bb</s>", "<s>c</s>", "\0"]}
    drive(driver, scripts)
    assert tools.batches == [[ToolCall("search", "a"), ToolCall("search", "bb")], [ToolCall("search", "c")]]
    eps = [g[0] for g in driver.episodes(1)]
    assert [len(e.turn_starts) for e in eps] == [2, 1, 3]
    assert [e.end_reason for e in eps] == ["stop", "stop", "stop"]
    assert driver.stats["tool_calls"] == 3 and driver.stats["turns"] == 6
    assert driver.stats["tool_requests"] == len(tools.batches) == 2
    assert [[len(g) for g in driver.episodes(n)] for n in (1, 3)] == [[1, 1, 1], [3]]


def test_the_turn_cap_ends_the_episode_with_length():
    driver, _ = make(1, max_turn_tokens=5)
    drive(driver, {0: ["<s>q</s>"]})  # 8 characters: the cap comes first
    (ep,), = driver.episodes(1)
    assert ep.end_reason == "length" and ep.finish_reason == "length" and len(ep.tokens) == 5


def test_a_call_on_the_last_allowed_turn_ends_with_max_turns_and_runs_no_tool():
    driver, tools = make(1, max_turns=2)
    drive(driver, {0: ["<s>a</s>", "<s>b</s>"]})
    (ep,), = driver.episodes(1)
    assert ep.end_reason == "max_turns" and len(ep.turn_starts) == 2
    assert tools.batches == [[ToolCall("search", "a")]] and ep.calls == [ToolCall("search", "a")]


def test_a_long_observation_ends_with_max_obs_tokens_and_is_not_appended():
    driver, _ = make(1, tools=FakeTools(long=20), max_obs_tokens=10)
    drive(driver, {0: ["<s>a</s>"]})
    (ep,), = driver.episodes(1)
    assert ep.end_reason == "max_obs_tokens" and ep.roles == [ROLE_ACTION] * 8 and ep.calls == []


def test_the_total_budget_ends_decoding_at_exactly_the_budget():
    driver, _ = make(1, max_total_tokens=6)
    drive(driver, {0: ["abcdefghij"]})
    (ep,), = driver.episodes(1)
    assert ep.end_reason == "max_total_tokens" and len(ep.tokens) == 6


def test_an_observation_that_leaves_no_room_for_a_turn_is_refused():
    driver, _ = make(2, max_total_tokens=14)
    # row 0: 8 + 4 observation tokens = 12 < 14 fits; row 1: 9 + 5 = 14 would leave no room for a turn
    drive(driver, {0: ["<s>a</s>", "\0"], 1: ["<s>ab</s>"]})
    ep0, ep1 = (g[0] for g in driver.episodes(1))
    assert ep0.end_reason == "stop" and len(ep0.tokens) == 13 and ep0.calls == [ToolCall("search", "a")]
    assert ep1.end_reason == "max_total_tokens" and len(ep1.tokens) == 9 and ep1.calls == []


def test_tool_unavailable_leaves_every_row_paused_and_a_retry_resumes_them():
    driver, tools = make(4, tools=FakeTools(fail=2), max_turns=2)
    turns = ["<s>q</s>"] * 3 + ["<a>1</a>"]  # row 3 answers: it ends, but only once the tools have answered
    for k in range(8):
        driver.record([0, 1, 2, 3], [ord(t[k]) for t in turns], [-1.0] * 4)
    assert driver.paused == [0, 1, 2, 3] and driver.decoding == []
    before = [list(driver.episode(r).tokens) for r in range(4)]
    for _ in range(2):
        with pytest.raises(ToolUnavailable):
            driver.resume()
        assert driver.paused == [0, 1, 2, 3] and [driver.episode(r).end_reason for r in range(4)] == [""] * 4
    assert [driver.episode(r).tokens for r in range(4)] == before
    fed = driver.resume()
    assert fed == {r: [ord(c) for c in "[Rq]"] for r in range(3)} and driver.episode(3).end_reason == "stop"
    assert len(tools.batches) == 3 and all(len(b) == 3 for b in tools.batches)
    assert driver.stats["tool_calls"] == 3 and driver.decoding == [0, 1, 2]


def test_record_refuses_a_row_that_is_not_decoding_and_episodes_refuse_live_rows():
    driver, _ = make(2)
    driver.record([0, 1], [ord("a"), EOS], [-1.0, -1.0])
    with pytest.raises(ValueError, match="row 1"):
        driver.record([1], [ord("a")], [-1.0])
    with pytest.raises(ValueError, match="not ended"):
        driver.episodes(1)
    with pytest.raises(ValueError, match="n=3"):
        driver.episodes(3)


def test_every_end_reason_is_known_and_finish_reason_maps_to_v1():
    for reason in END_REASONS:
        assert Episode(end_reason=reason).finish_reason == ("length" if reason == "length" else "stop")
