"""Multi-turn episodes on the MLX engine: paused rows' caches, observations fed exactly, logprobs that a full
torch forward of prompt + episode recomputes, and agreement with the torch engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import mlx.core as mx
import numpy as np
import pytest

from stoa.engines.base import GenStats
from stoa.envs.base import Observation, ToolResult, ToolUnavailable, observation_tokens
from stoa.episodes.driver import Episode, EpisodeDriver
from stoa.rollouts.episode import ROLE_ACTION, ROLE_ECHO, ROLE_MASKED, EpisodeLimits, ToolCall
from tests.engines.nucleus import MAX_EDGE_SHARE

pytestmark = pytest.mark.mlx

PROMPTS = [[5, 6, 7, 8, 9, 40, 41], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 300, 301]]
EOS = (2, 3, 4, 5, 6)
LIMITS = EpisodeLimits(max_turns=4, max_turn_tokens=10, max_obs_tokens=40, max_total_tokens=160)
TOL = 1e-4  # the single-turn MLX-vs-torch gate (tests/engines/test_mlx_engine.py)


class TinyEnv:
    """For the random tiny model: a turn pauses at ``e``; a paused turn containing ``w`` answers (ends);
    any other searches for its last 6 characters; observations ``<information>`` result ``</information>``."""

    stop_strings: tuple[str, ...] = ("e",)

    def __init__(self, row: int):
        self.state = f"s{row}"

    def initial_state(self) -> str:
        return self.state

    def parse(self, turn_text: str) -> ToolCall | None:
        return None if "w" in turn_text else ToolCall("search", turn_text[-6:])

    def observe(self, call: ToolCall, result: ToolResult) -> Observation:
        self.state = f"{self.state}|{result.digest}"
        return Observation(segments=(("<information>", ROLE_MASKED), (result.text, ROLE_ECHO),
                                     ("</information>", ROLE_MASKED)), state=self.state)


class FixedTools:
    """A fake search: a fixed text with the query's length in it; records every batch; may fail first."""

    def __init__(self, fail: int = 0):
        self.batches: list[list[ToolCall]] = []
        self.fail = fail

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        self.batches.append(list(calls))
        if self.fail:
            self.fail -= 1
            raise ToolUnavailable("retriever down")
        return [ToolResult(f"Doc 1(Title: apples) Tom has {len(c.arguments)} books.", f"d{len(c.arguments)}")
                for c in calls]


@pytest.fixture(scope="module")
def codec(tiny_dir):
    from stoa.tokenize import TextCodec

    return TextCodec(tiny_dir)


def make_driver(codec, rows: int, tools: FixedTools | None = None,
                limits: EpisodeLimits = LIMITS) -> tuple[EpisodeDriver, FixedTools]:
    tools = tools or FixedTools()
    return EpisodeDriver([TinyEnv(r) for r in range(rows)], tools, codec, limits, EOS), tools


def run(engine, codec, prompts=PROMPTS, n: int = 4, **kw) -> tuple[list[list[Episode]], FixedTools, GenStats]:
    driver, tools = make_driver(codec, len(prompts) * n)
    groups, stats = engine.generate_episodes(prompts, n, driver, **kw)
    return groups, tools, stats


def recompute(model, prompt: list[int], ep: Episode, temperature: float, top_p: float) -> tuple[np.ndarray, int]:
    """|recorded - torch fp32 recompute| of every token of ``ep`` after ``prompt`` (one full forward, the sampling
    distribution; tests/engines/nucleus.py's allowance at the top-p edge) and the positions that used it."""
    import torch

    from tests.engines.nucleus import edge_aware_gaps

    ids = torch.tensor([prompt + ep.tokens])
    with torch.no_grad():
        logits = model(ids).logits.float()[0, len(prompt) - 1 : -1]
    return edge_aware_gaps(logits, ep.tokens, np.array(ep.logprobs, dtype=np.float64), temperature, top_p, TOL)


def assert_multi_turn(groups: list[list[Episode]]) -> None:
    """Episodes really had several turns and observations (the fake env fits the tiny model)."""
    eps = [e for g in groups for e in g]
    assert max(len(e.turn_starts) for e in eps) >= 3
    assert sum(len(e.calls) for e in eps) >= len(eps)


# ------------------------------------------------------------------------------------------ cache mechanics
def _decoded_batch(engine, steps: int):
    """Three prompts x 2 rows, prefilled and greedily decoded ``steps`` tokens; rows 0 and 3 dropped."""
    from stoa.engines.mlx.kv import compact
    from stoa.engines.mlx.sampling import Draw

    cache, logits = engine._prefill_groups(PROMPTS, 2, True, GenStats())
    toks: list[list[int]] = [[] for _ in range(6)]
    cur = mx.argmax(logits, axis=-1)
    for _ in range(steps):
        for r, t in enumerate(cast(list, cur.tolist())):
            toks[r].append(t)
        cur = mx.argmax(engine.model(cur[:, None], cache=cache)[:, -1, :], axis=-1)
    active, _ = compact(cache, list(range(6)), [1, 2, 4, 5], Draw(cur, cur, None))
    return cache, active, toks


def _full_logits(engine, ids: list[int]) -> mx.array:
    return engine.model(mx.array(ids)[None])[0, -1]


def test_a_row_taken_out_of_the_batch_and_fed_at_batch_1_matches_a_full_forward(mlx_engine) -> None:
    from stoa.engines.mlx.kv import feed, take_row

    cache, active, toks = _decoded_batch(mlx_engine, 5)
    extra = [100, 101, 102, 7]
    for i, r in enumerate(active):
        prompt = PROMPTS[r // 2]
        row = take_row(cache, i, drop_last=1)  # the last fed token is left out, and fed again first
        assert row[0].offset == len(prompt) + 4 and row[0].keys.shape[:3] == (1, 2, len(prompt) + 4)
        got = feed(mlx_engine.model, row, [toks[r][-1], *extra], chunk=2)
        assert row[0].offset == len(prompt) + 5 + len(extra)
        want = _full_logits(mlx_engine, prompt + toks[r] + extra)
        assert float(mx.abs(got[0] - want).max()) <= 1e-5


def test_rows_of_different_lengths_merge_into_one_batch_that_decodes_like_each_row(mlx_engine) -> None:
    from stoa.engines.mlx.kv import feed, merge_rows, take_row

    cache, active, toks = _decoded_batch(mlx_engine, 3)
    obs = {1: [50], 2: [51, 52, 53, 54, 55, 56], 4: [57, 58, 59]}
    rows = {r: take_row(cache, i, drop_last=1) for i, r in enumerate(active) if r in obs}
    for r, row in rows.items():
        feed(mlx_engine.model, row, [toks[r][-1], *obs[r]], chunk=4)
    merged = [merge_rows([rows[r][layer] for r in obs]) for layer in range(len(cache))]
    nxt = [9, 10, 11]
    got = mlx_engine.model(mx.array(nxt)[:, None], cache=merged)[:, -1, :]
    for b, r in enumerate(obs):
        want = _full_logits(mlx_engine, PROMPTS[r // 2] + toks[r] + obs[r] + [nxt[b]])
        assert float(mx.abs(got[b] - want).max()) <= 1e-5


def test_take_row_refuses_to_drop_more_than_the_row_holds(mlx_engine) -> None:
    from stoa.engines.mlx.kv import take_row

    cache, _, _ = _decoded_batch(mlx_engine, 1)
    with pytest.raises(ValueError, match="drop_last"):
        take_row(cache, 1, drop_last=100)


# ------------------------------------------------------------------------------------------------ episodes
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.9)])
def test_recorded_logprobs_match_a_torch_full_forward(mlx_engine, torch_engine, codec, temperature,
                                                      top_p) -> None:
    groups, _, _ = run(mlx_engine, codec, temperature=temperature, top_p=top_p, generator=3)
    assert_multi_turn(groups)
    worst, edge, actions = 0.0, 0, 0
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for ep in group:
            roles = np.array(ep.roles)
            lps = np.array(ep.logprobs)
            assert len(ep.tokens) == len(roles) == len(lps) and (roles == ROLE_ACTION).any()
            assert np.isfinite(lps).all() and (lps[roles != ROLE_ACTION] == 0.0).all()
            gaps, on_edge = recompute(torch_engine.model, prompt, ep, temperature, top_p)
            worst = max(worst, float(gaps[roles == ROLE_ACTION].max()))
            edge, actions = edge + on_edge, actions + int((roles == ROLE_ACTION).sum())
    assert worst <= TOL, f"max |MLX - torch| action logprob difference {worst:.2e} > {TOL}"
    assert edge <= MAX_EDGE_SHARE * actions, f"{edge} of {actions} tokens needed the nucleus-edge allowance"


def test_observation_tokens_appear_exactly_with_roles_and_zero_logprobs(mlx_engine, codec) -> None:
    groups, tools, stats = run(mlx_engine, codec, generator=5)
    assert_multi_turn(groups)
    rows = [e for g in groups for e in g]
    for r, ep in enumerate(rows):
        env, cut = TinyEnv(r), 0
        starts = ep.turn_starts[1:] + [len(ep.tokens)]
        for k, call in enumerate(ep.calls):  # the observation sits between an action run and the next turn
            result = FixedTools().run([call])[0]
            assert result.digest == ep.digests[k]
            toks, roles = observation_tokens(env.observe(call, result), codec)
            end = starts[k]
            assert ep.tokens[end - len(toks) : end] == toks and ep.roles[end - len(toks) : end] == roles
            assert ep.logprobs[end - len(toks) : end] == [0.0] * len(toks)
            assert ROLE_ECHO in roles and ep.roles[end - len(toks) - 1] == ROLE_ACTION
            assert ep.states[k + 1] == env.state
            cut += len(toks)
        assert sum(1 for x in ep.roles if x != ROLE_ACTION) == cut
    # one request per round or refill at most, holding every call that became an observation
    assert 1 <= len(tools.batches) <= stats.extra["rounds"] + stats.extra["refills"]
    assert sum(len(b) for b in tools.batches) >= sum(len(e.calls) for e in rows)


def test_rows_finish_independently_and_equal_their_episode_run_alone(mlx_engine, codec) -> None:
    groups, _, stats = run(mlx_engine, codec, n=2, greedy=True, temperature=0.9)
    eps = [e for g in groups for e in g]
    assert len({len(e.turn_starts) for e in eps}) > 1 and len({len(e.tokens) for e in eps}) > 1
    for r, ep in enumerate(eps):  # each row alone at batch 1 (row r's env) gives the same episode
        driver = EpisodeDriver([TinyEnv(r)], FixedTools(), codec, LIMITS, EOS)
        (alone,), = mlx_engine.generate_episodes([PROMPTS[r // 2]], 1, driver, greedy=True, temperature=0.9)[0]
        assert alone.tokens == ep.tokens and alone.roles == ep.roles and alone.end_reason == ep.end_reason
        np.testing.assert_allclose(alone.logprobs, ep.logprobs, atol=1e-5)
    actions = sum(r == ROLE_ACTION for e in eps for r in e.roles)
    assert stats.new_tokens == actions and stats.extra["turns"] == sum(len(e.turn_starts) for e in eps)
    resumed = sum(len(e.calls) for e in eps)
    assert stats.extra["obs_prefill_tokens"] == stats.extra["obs_tokens"] + resumed
    assert stats.extra["rounds"] + stats.extra["refills"] >= 3
    assert stats.extra["prompt_tokens"] == sum(len(p) for p in PROMPTS)
    assert stats.prefill_s > stats.extra["obs_prefill_s"] > 0 and stats.decode_s > 0


def test_greedy_episodes_identical_to_torch_engine(mlx_engine, torch_engine, codec) -> None:
    a, _, _ = run(mlx_engine, codec, n=2, greedy=True, temperature=0.8)
    b, _, _ = run(torch_engine, codec, n=2, greedy=True, temperature=0.8)
    assert_multi_turn(a)
    for ga, gb in zip(a, b, strict=True):
        for ea, eb in zip(ga, gb, strict=True):
            assert (ea.tokens, ea.roles, ea.turn_starts, ea.calls, ea.end_reason) == (
                eb.tokens, eb.roles, eb.turn_starts, eb.calls, eb.end_reason)
            np.testing.assert_allclose(ea.logprobs, eb.logprobs, atol=TOL)


def test_seeded_episodes_are_reproducible(mlx_engine, codec) -> None:
    def tokens(seed):
        groups, _, _ = run(mlx_engine, codec, n=3, temperature=1.2, generator=seed)
        return [e.tokens for g in groups for e in g]

    assert tokens(7) == tokens(7) and tokens(7) != tokens(8)


def test_tool_unavailable_propagates(mlx_engine, codec) -> None:
    driver, tools = make_driver(codec, 4, FixedTools(fail=1))
    with pytest.raises(ToolUnavailable):
        mlx_engine.generate_episodes([PROMPTS[0]], 4, driver, generator=1)
    assert len(tools.batches) == 1 and driver.paused


def test_a_driver_of_another_size_or_an_used_one_is_refused(mlx_engine, codec) -> None:
    driver, _ = make_driver(codec, 5)
    with pytest.raises(ValueError, match="driver: it holds 5 rows"):
        mlx_engine.generate_episodes([PROMPTS[0]], 4, driver)
    driver, _ = make_driver(codec, 2)
    mlx_engine.generate_episodes([PROMPTS[0]], 2, driver, generator=1)
    with pytest.raises(ValueError, match="new driver per call"):
        mlx_engine.generate_episodes([PROMPTS[0]], 2, driver)


def test_an_observation_outside_the_vocabulary_is_refused(mlx_engine, codec) -> None:
    class WideCodec:
        def encode_text(self, text: str) -> list[int]:
            return [mlx_engine.vocab_size + 1]

        def decode(self, tokens: Sequence[int]) -> str:
            return codec.decode(tokens)

    driver = EpisodeDriver([TinyEnv(r) for r in range(4)], FixedTools(), WideCodec(), LIMITS, EOS)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        mlx_engine.generate_episodes([PROMPTS[0]], 4, driver, generator=1)


class RaggedTools(FixedTools):
    """Results whose length follows the query's, so the rows resumed in one round feed different lengths."""

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        return [ToolResult(f"Doc{' apples' * (len(c.arguments) % 5)}", r.digest)
                for c, r in zip(calls, super().run(calls), strict=True)]


def run_ragged(engine, codec, seed: int, greedy: bool) -> tuple[list[Episode], GenStats]:
    driver, _ = make_driver(codec, len(PROMPTS) * 2, RaggedTools())
    groups, stats = engine.generate_episodes(PROMPTS, 2, driver, greedy=greedy, temperature=0.9, generator=seed)
    assert_multi_turn(groups)
    return [e for g in groups for e in g], stats


@pytest.mark.parametrize("seed,greedy,refill", [(3, False, True), (5, True, False)])
def test_batched_observation_prefill_equals_feeding_rows_one_at_a_time(mlx_engine, codec, seed, greedy,
                                                                      refill) -> None:
    """All rows resumed in a round are fed in one forward (shorter rows re-feed their cache's last tokens): the
    same tokens, roles and calls as the batch-1 path, and the same logprobs to the fp32 gate (greedy rows pause
    together only when rounds wait for every row: ``refill`` off)."""
    mlx_engine.refill = refill
    try:
        batched, stats = run_ragged(mlx_engine, codec, seed, greedy)
        mlx_engine.batch_resumes = False
        single, alone = run_ragged(mlx_engine, codec, seed, greedy)
    finally:
        mlx_engine.batch_resumes, mlx_engine.refill = True, True
    assert stats.extra["obs_prefill_batched"] >= 2 and stats.extra["obs_prefill_refed"] > 0  # ragged rounds
    assert alone.extra["obs_prefill_batched"] == 0
    for a, b in zip(batched, single, strict=True):
        assert (a.tokens, a.roles, a.turn_starts, a.calls, a.end_reason) == (
            b.tokens, b.roles, b.turn_starts, b.calls, b.end_reason)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def _no_refill(engine, codec, **kw) -> tuple[list[list[Episode]], GenStats]:
    engine.refill = False
    try:
        groups, _, stats = run(engine, codec, **kw)
    finally:
        engine.refill = True
    return groups, stats


def test_refilled_rows_decode_as_rows_that_wait_for_the_round(mlx_engine, codec) -> None:
    """Rows that pause while others decode are resumed at once and join the batch (``BatchKVCache.extend``): greedy
    episodes equal those of rounds that wait until no row decodes (tokens, roles, calls; logprobs to the gate)."""
    joined, _, stats = run(mlx_engine, codec, n=2, greedy=True, temperature=0.9)
    waited, still = _no_refill(mlx_engine, codec, n=2, greedy=True, temperature=0.9)
    assert_multi_turn(joined)
    assert stats.extra["refills"] >= 2 and still.extra["refills"] == 0
    for a, b in zip((e for g in joined for e in g), (e for g in waited for e in g), strict=True):
        assert (a.tokens, a.roles, a.turn_starts, a.calls, a.end_reason) == (
            b.tokens, b.roles, b.turn_starts, b.calls, b.end_reason)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


@pytest.mark.parametrize("seed", [1, 2])
def test_with_refill_no_step_waits_on_a_tool(mlx_engine, codec, seed) -> None:
    """With refill (the default) a batch takes as many steps as its longest episode has action tokens; rounds
    that wait for every row to stop take more steps with the same rows."""
    def steps_over_longest(groups, stats) -> tuple[int, int]:
        return stats.steps, max(sum(r == ROLE_ACTION for r in e.roles) for g in groups for e in g)

    groups, _, stats = run(mlx_engine, codec, generator=seed)
    assert_multi_turn(groups)
    steps, longest = steps_over_longest(groups, stats)
    assert steps == longest
    waited, longest_waited = steps_over_longest(*_no_refill(mlx_engine, codec, generator=seed))
    assert waited > longest_waited
