"""TorchEngine.generate_episodes on the tiny model: multi-turn logprobs equal a full-forward recompute (the
agreement gate), observations are the env's tokenised text, rows are independent, one tool request a round."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from stoa.engines.torch import sampling_logprobs_torch
from stoa.envs.base import Observation, ToolResult, action_runs, observation_tokens
from stoa.episodes.driver import Episode, EpisodeDriver
from stoa.rollouts.episode import ROLE_ACTION, ROLE_ECHO, ROLE_MASKED, EpisodeLimits, ToolCall
from stoa.tokenize import TextCodec

TOL = 1e-5  # the fp32 worker-vs-trainer gate of tests/integration/test_loop_local.py
LIMITS = EpisodeLimits(max_turns=3, max_turn_tokens=8, max_obs_tokens=40, max_total_tokens=80)
QUESTIONS = ("What is the sum?", "Tom buys apples and gives some of them to Anna.", "Why?")


class LetterEnv:
    """The random tiny model writes 'a' and 'e' often: they end a turn, whose text is the search query
    (a turn with 'Ann' answers instead), so episodes really have several turns."""

    stop_strings: tuple[str, ...] = ("a", "e")

    def __init__(self) -> None:
        self.state = "s"

    def initial_state(self) -> str:
        return "s"

    def parse(self, turn_text: str) -> ToolCall | None:
        return None if "Ann" in turn_text else ToolCall("search", turn_text)

    def observe(self, call: ToolCall, result: ToolResult) -> Observation:
        self.state = f"{self.state}/{result.digest}"
        return Observation(segments=(("\n<information>", ROLE_MASKED), (result.text, ROLE_ECHO),
                                     ("</information>\n", ROLE_MASKED)), state=self.state)


def answer(call: ToolCall) -> ToolResult:
    return ToolResult(f"Doc 1(Title: {len(call.arguments)}) apples", str(len(call.arguments)))


class RecordingTools:
    def __init__(self) -> None:
        self.batches: list[list[ToolCall]] = []

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        self.batches.append(list(calls))
        return [answer(c) for c in calls]


@pytest.fixture(scope="module")
def codec(tiny_dir) -> TextCodec:
    return TextCodec(tiny_dir)


def prompts_of(codec: TextCodec, questions: Sequence[str]) -> list[list[int]]:
    return [codec.encode_prompt([{"role": "user", "content": q}]) for q in questions]


def run(engine, codec: TextCodec, questions: Sequence[str], n: int, seed: int = 1, greedy: bool = False,
        temperature: float = 0.9, top_p: float = 1.0) -> tuple[list[list[Episode]], RecordingTools, dict]:
    tools = RecordingTools()
    driver = EpisodeDriver([LetterEnv() for _ in range(len(questions) * n)], tools, codec, LIMITS, codec.eos_ids)
    groups, stats = engine.generate_episodes(prompts_of(codec, questions), n, driver, temperature=temperature,
                                             top_p=top_p, generator=engine.make_generator(seed), greedy=greedy)
    return groups, tools, stats.extra


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_multi_turn_logprobs_equal_a_full_forward_recompute(torch_engine, codec, top_p):
    groups, _, extra = run(torch_engine, codec, QUESTIONS[:2], 3, top_p=top_p)
    eps = [e for g in groups for e in g]
    assert max(len(e.turn_starts) for e in eps) >= 2 and extra["tool_calls"] >= 2  # tools really ran
    assert extra["refills"] >= 1  # resumed rows joined rows still decoding
    worst = 0.0
    for prompt, group in zip(prompts_of(codec, QUESTIONS[:2]), groups, strict=True):
        for e in group:
            with torch.no_grad():
                logits = torch_engine.model(input_ids=torch.tensor([prompt + e.tokens])).logits[0]
            lp = sampling_logprobs_torch(logits[len(prompt) - 1:-1], 0.9, top_p)
            ref = lp.gather(-1, torch.tensor(e.tokens)[:, None])[:, 0].numpy()
            act = np.array(e.roles) == ROLE_ACTION
            assert np.all(np.array(e.logprobs)[~act] == 0.0)
            worst = max(worst, float(np.abs(ref[act] - np.array(e.logprobs)[act]).max()))
    assert worst < TOL, f"multi-turn logprobs drift from the recompute: max |d| {worst:.2e}"


def test_observations_are_the_envs_tokenised_text_and_turns_line_up(torch_engine, codec):
    groups, _, _ = run(torch_engine, codec, QUESTIONS[:2], 3, seed=2)
    for e in (e for g in groups for e in g):
        runs = action_runs(e.roles)
        assert [a for a, _ in runs] == e.turn_starts and len(e.states) == len(e.turn_starts)
        assert len(e.calls) == len(e.digests) >= len(runs) - 1 and len(e.tokens) <= LIMITS.max_total_tokens
        env = LetterEnv()
        for k, ((_, end), call) in enumerate(zip(runs, e.calls, strict=False)):
            obs = env.observe(call, answer(call))
            toks, roles = observation_tokens(obs, codec)
            assert e.tokens[end:end + len(toks)] == toks and e.roles[end:end + len(toks)] == roles
            assert end + len(toks) == e.turn_starts[k + 1] and e.states[k + 1] == obs.state
            assert call == ToolCall("search", codec.decode(e.tokens[runs[k][0]:end]))


def test_rows_finish_independently_of_the_batch(torch_engine, codec):
    together, _, _ = run(torch_engine, codec, QUESTIONS, 1, greedy=True)
    eps = [g[0] for g in together]
    assert len({(len(e.tokens), len(e.turn_starts)) for e in eps}) > 1  # rows really differ
    for q, e in zip(QUESTIONS, eps, strict=True):
        (alone,), _, _ = run(torch_engine, codec, [q], 1, greedy=True)
        assert (alone[0].tokens, alone[0].roles, alone[0].turn_starts, alone[0].end_reason) == (
            e.tokens, e.roles, e.turn_starts, e.end_reason)
        np.testing.assert_allclose(alone[0].logprobs, e.logprobs, atol=TOL)


def test_one_tool_request_per_round_holds_every_paused_rows_call(torch_engine, codec):
    torch_engine.refill = False  # rounds end only when no row decodes
    try:
        groups, tools, extra = run(torch_engine, codec, QUESTIONS[:2], 3, seed=3)
    finally:
        torch_engine.refill = True
    eps = [e for g in groups for e in g]
    assert len(tools.batches) >= 2 and max(len(b) for b in tools.batches) >= 2
    # round k runs the (k+1)-th call of every row still going (no observation is refused at these limits)
    assert tools.batches == [[e.calls[k] for e in eps if len(e.calls) > k] for k in range(len(tools.batches))]
    assert extra["tool_calls"] == sum(len(b) for b in tools.batches) and extra["rounds"] >= len(tools.batches)
    assert extra["refills"] == 0


def test_paused_rows_refill_the_batch_while_others_decode(torch_engine, codec):
    """With refill_share=1, paused rows resume once as many wait as decode: tool requests are made while
    rows still decode, each still holds several rows' calls, and every row's k-th call precedes its (k+1)-th."""
    torch_engine.refill_share = 1.0
    try:
        groups, tools, extra = run(torch_engine, codec, QUESTIONS, 3, seed=3)
    finally:
        torch_engine.refill_share = 0.0
    eps = [e for g in groups for e in g]
    assert extra["refills"] >= 1 and max(len(b) for b in tools.batches) >= 2
    calls = [c for b in tools.batches for c in b]
    assert sorted(map(repr, calls)) == sorted(repr(c) for e in eps for c in e.calls)  # every call ran once
    assert extra["tool_calls"] == len(calls)


def _steps_and_longest(torch_engine, codec, seed: int) -> tuple[int, int, dict]:
    tools = RecordingTools()
    driver = EpisodeDriver([LetterEnv() for _ in range(len(QUESTIONS) * 3)], tools, codec, LIMITS, codec.eos_ids)
    groups, stats = torch_engine.generate_episodes(prompts_of(codec, QUESTIONS), 3, driver, temperature=0.9,
                                                   generator=torch_engine.make_generator(seed))
    longest = max(sum(r == ROLE_ACTION for r in e.roles) for g in groups for e in g)
    return stats.steps, longest, stats.extra


@pytest.mark.parametrize("seed", [3, 10])
def test_by_default_a_paused_row_resumes_at_once_so_no_step_waits_on_a_tool(torch_engine, codec, seed):
    """refill_share=0 (the default): a row that pauses is resumed before the next decode step, so the batch takes
    exactly as many steps as its longest episode has action tokens; waiting for more rows to pause
    (refill_share=1) takes more steps with the same rows."""
    assert torch_engine.refill_share == 0.0
    steps, longest, extra = _steps_and_longest(torch_engine, codec, seed)
    assert extra["tool_calls"] >= 3 and extra["refills"] >= 2
    assert steps == longest
    torch_engine.refill_share = 1.0
    try:
        waited, longest_waited, _ = _steps_and_longest(torch_engine, codec, seed)
    finally:
        torch_engine.refill_share = 0.0
    assert waited > longest_waited


def test_episodes_are_deterministic(torch_engine, codec):
    for greedy in (True, False):
        a, _, _ = run(torch_engine, codec, QUESTIONS[:2], 2, seed=5, greedy=greedy)
        b, _, _ = run(torch_engine, codec, QUESTIONS[:2], 2, seed=5, greedy=greedy)
        assert [[(e.tokens, e.logprobs, e.roles) for e in g] for g in a] == [
            [(e.tokens, e.logprobs, e.roles) for e in g] for g in b]


def test_a_driver_of_another_batch_size_is_refused(torch_engine, codec):
    driver = EpisodeDriver([LetterEnv()], RecordingTools(), codec, LIMITS, codec.eos_ids)
    with pytest.raises(ValueError, match="driver"):
        torch_engine.generate_episodes(prompts_of(codec, QUESTIONS[:2]), 1, driver)


@pytest.mark.parametrize("seed,greedy", [(1, False), (2, False), (4, False), (5, True)])
def test_the_trainers_replay_accepts_every_honest_episode(torch_engine, codec, seed, greedy):
    """Every episode the driver recorded ends its turns where the replay re-derives them (stop strings 'a' and
    'e' are matched on decoded text, so multi-character tokens end turns mid-token): zero false rejections."""
    from stoa.episodes.collect import episode_sample
    from stoa.episodes.replay import replay_group

    groups, _, _ = run(torch_engine, codec, QUESTIONS, 3, seed=seed, greedy=greedy)
    eps = [e for g in groups for e in g]
    assert {e.end_reason for e in eps} - {"stop"} and max(len(e.calls) for e in eps) >= 2  # varied episodes
    samples = [episode_sample(e, 0.0) for e in eps]
    out = replay_group([LetterEnv() for _ in samples], samples, RecordingTools(), codec, LIMITS, codec.eos_ids)
    assert [r.calls for r in out] == [len(e.calls) for e in eps]


@pytest.mark.parametrize("seed,greedy,share", [(3, False, 0.0), (5, True, 1.0)])
def test_batched_observation_prefill_equals_feeding_rows_one_at_a_time(torch_engine, codec, seed, greedy, share):
    """All rows resumed in a round are fed in one forward: same tokens, roles and calls as the batch-1 path, the
    same logprobs to the fp32 gate, and the round's feed holds several rows of different lengths (greedy rows
    pause together only when rounds wait: ``refill_share=1``)."""
    from stoa.engines import torch_rows

    widths: list[int] = []
    real = torch_rows.feed_batch

    def spy(model, cache_kw, rows, fed):
        widths.append(len({len(t) for t in fed.values()}) * 100 + len(fed))
        return real(model, cache_kw, rows, fed)

    torch_rows.feed_batch, torch_engine.refill_share = spy, share
    try:
        batched, _, _ = run(torch_engine, codec, QUESTIONS, 3, seed=seed, greedy=greedy)
        torch_engine.batch_resumes = False
        single, _, _ = run(torch_engine, codec, QUESTIONS, 3, seed=seed, greedy=greedy)
    finally:
        torch_rows.feed_batch, torch_engine.batch_resumes, torch_engine.refill_share = real, True, 0.0
    assert any(w % 100 >= 2 for w in widths) and any(w // 100 >= 2 for w in widths)  # several rows, ragged
    for a, b in zip((e for g in batched for e in g), (e for g in single for e in g), strict=True):
        assert (a.tokens, a.roles, a.turn_starts, a.calls, a.end_reason) == (
            b.tokens, b.roles, b.turn_starts, b.calls, b.end_reason)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=TOL)
