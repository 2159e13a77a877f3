"""Continuous batching of episodes on the MLX engine (``decode_slots`` below the rows): while episodes wait in the
queue every decode step holds ``decode_slots`` rows, admitted rows decode exactly as they do in one full batch, each
prompt is prefilled once, rows waiting for a tool keep their slots, and the logprobs still equal a full-forward
recompute (as tests/engines/test_torch_slots.py on the torch engine)."""

from __future__ import annotations

import numpy as np
import pytest

from stoa.rollouts.episode import ROLE_ACTION
from tests.engines.counting_driver import CountingDriver
from tests.engines.test_mlx_episodes import EOS, LIMITS, PROMPTS, TOL, FixedTools, TinyEnv, assert_multi_turn, recompute

pytestmark = pytest.mark.mlx

N = 3
ROWS = len(PROMPTS) * N


@pytest.fixture(scope="module")
def codec(tiny_dir):
    from stoa.tokenize import TextCodec

    return TextCodec(tiny_dir)


def run_slots(engine, codec, slots: int, seed: int = 3, greedy: bool = False, refill: bool = True):
    driver = CountingDriver([TinyEnv(r) for r in range(ROWS)], FixedTools(), codec, LIMITS, EOS)
    engine.decode_slots, engine.refill = slots, refill
    try:
        groups, stats = engine.generate_episodes(PROMPTS, N, driver, temperature=0.9, generator=seed, greedy=greedy)
    finally:
        engine.decode_slots, engine.refill = 0, True
    return groups, stats, driver


@pytest.mark.parametrize("slots,seed", [(4, 3), (2, 10), (5, 1)])
def test_every_step_decodes_the_slot_count_while_episodes_wait(mlx_engine, codec, slots, seed):
    groups, stats, driver = run_slots(mlx_engine, codec, slots, seed=seed)
    waiting = [rows for rows, queued in driver.steps if queued]
    assert len(waiting) >= 3 and stats.extra["admitted"] == ROWS - slots  # the queue really ran
    assert waiting == [slots] * len(waiting)
    assert max(rows for rows, _ in driver.steps) == slots
    assert stats.extra["tool_calls"] >= 2 and all(e.end_reason for g in groups for e in g)


@pytest.mark.parametrize("slots", [2, 4])
def test_admitted_episodes_equal_those_of_one_full_batch(mlx_engine, codec, slots):
    """Greedy: an episode admitted into a freed slot mid-flight is token for token the episode of the batch that
    decodes every row at once (and so of the row run alone: ``test_rows_finish_independently_...``)."""
    full, _, _ = run_slots(mlx_engine, codec, 0, greedy=True)
    queued, stats, _ = run_slots(mlx_engine, codec, slots, greedy=True)
    assert_multi_turn(full)
    assert stats.extra["admitted"] == ROWS - slots and len({len(e.tokens) for g in full for e in g}) > 1
    for a, b in zip((e for g in full for e in g), (e for g in queued for e in g), strict=True):
        assert (a.tokens, a.roles, a.turn_starts, a.calls, a.end_reason) == (
            b.tokens, b.roles, b.turn_starts, b.calls, b.end_reason)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_rows_waiting_for_their_tools_keep_their_slots(mlx_engine, codec):
    """Without refill paused rows wait until no row decodes; they hold their slots meanwhile, so rows decoding plus
    rows waiting never exceed the slots, and every episode still ends."""
    groups, stats, driver = run_slots(mlx_engine, codec, 4, seed=3, refill=False)
    assert stats.extra["admitted"] == ROWS - 4 and max(driver.held) == 4
    assert any(held > rows for held, (rows, _) in zip(driver.held, driver.steps, strict=True))  # rows did wait
    assert all(e.end_reason for g in groups for e in g)


def test_admitted_episodes_logprobs_equal_a_full_forward_recompute(mlx_engine, torch_engine, codec):
    groups, stats, _ = run_slots(mlx_engine, codec, 4, seed=4)
    assert stats.extra["admitted"] >= 1 and stats.extra["refills"] >= 1
    assert_multi_turn(groups)
    worst = 0.0
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for e in group:
            gaps, _ = recompute(torch_engine.model, prompt, e, 0.9, 1.0)
            worst = max(worst, float(gaps[np.array(e.roles) == ROLE_ACTION].max()))
    assert worst < TOL, f"admitted rows' logprobs drift from the recompute: max |d| {worst:.2e}"


def test_each_prompt_is_prefilled_once_though_its_rows_are_admitted_apart(mlx_engine, codec, monkeypatch):
    """4 slots, 3 rows a prompt: prompt 1's rows are admitted over two calls; every prompt is prefilled once."""
    prefilled: list[int] = []
    real = mlx_engine._prefill

    def spy(prompt, rows):
        prefilled.append(len(prompt))
        return real(prompt, rows)

    monkeypatch.setattr(mlx_engine, "_prefill", spy)
    _, stats, _ = run_slots(mlx_engine, codec, 4)
    assert sorted(prefilled) == sorted(len(p) for p in PROMPTS)
    assert stats.extra["prompt_tokens"] == sum(len(p) for p in PROMPTS)
    assert stats.prefill_s > stats.extra["admit_prefill_s"] > 0 and stats.decode_s > 0


def test_a_negative_slot_count_is_refused(mlx_engine, codec):
    with pytest.raises(ValueError, match="decode_slots"):
        run_slots(mlx_engine, codec, -1)


def test_a_hybrids_queue_admits_a_new_wave_once_its_batch_has_ended(stoa_cache):
    """lfm2 (conv state layers): rows never join a decoding batch, so the queue admits ``decode_slots`` rows each
    time the batch is empty; greedy episodes still equal the full batch's and no step exceeds the slots."""
    from stoa.engines.mlx.engine import MLXEngine
    from stoa.models import resolve_model
    from stoa.tokenize import TextCodec

    d = resolve_model("tiny-lfm2", cache_dir=stoa_cache)
    engine, lfm_codec = MLXEngine(d, dtype="float32"), TextCodec(d)
    full, _, _ = run_slots(engine, lfm_codec, 0, greedy=True)
    queued, stats, driver = run_slots(engine, lfm_codec, 4, greedy=True)
    assert stats.extra["admitted"] == ROWS - 4 and max(driver.held) <= 4
    seen: set[int] = set()
    for active in driver.actives:  # a step decodes old rows only or new rows only: no row joins a decoding batch
        new = set(active) - seen
        assert not new or new == set(active)
        seen |= new
    for a, b in zip((e for g in full for e in g), (e for g in queued for e in g), strict=True):
        assert (a.tokens, a.roles, a.calls, a.end_reason) == (b.tokens, b.roles, b.calls, b.end_reason)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)
