"""Continuous batching of episodes on the torch engine (``decode_slots`` below the rows): while episodes wait in the
queue every decode step holds ``decode_slots`` rows, admitted rows decode exactly as they do in one full batch, each
prompt is prefilled once, and the logprobs still equal a full-forward recompute."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stoa.engines.torch import sampling_logprobs_torch
from stoa.rollouts.episode import ROLE_ACTION
from stoa.tokenize import TextCodec
from tests.engines.counting_driver import CountingDriver
from tests.engines.test_torch_episodes import LIMITS, QUESTIONS, TOL, LetterEnv, RecordingTools, prompts_of


@pytest.fixture(scope="module")
def codec(tiny_dir) -> TextCodec:
    return TextCodec(tiny_dir)


def run_slots(engine, codec, slots: int, n: int = 3, seed: int = 3, greedy: bool = False):
    driver = CountingDriver([LetterEnv() for _ in range(len(QUESTIONS) * n)], RecordingTools(), codec, LIMITS,
                            codec.eos_ids)
    engine.decode_slots = slots
    try:
        groups, stats = engine.generate_episodes(prompts_of(codec, QUESTIONS), n, driver, temperature=0.9,
                                                 generator=engine.make_generator(seed), greedy=greedy)
    finally:
        engine.decode_slots = 0
    return groups, stats, driver


@pytest.mark.parametrize("slots,seed", [(4, 3), (2, 10), (5, 1)])
def test_every_step_decodes_the_slot_count_while_episodes_wait(torch_engine, codec, slots, seed):
    groups, stats, driver = run_slots(torch_engine, codec, slots, seed=seed)
    waiting = [rows for rows, queued in driver.steps if queued]
    assert len(waiting) >= 3 and stats.extra["admitted"] == len(QUESTIONS) * 3 - slots  # the queue really ran
    assert waiting == [slots] * len(waiting)
    assert max(rows for rows, _ in driver.steps) == slots
    assert stats.extra["tool_calls"] >= 2 and all(e.end_reason for g in groups for e in g)


@pytest.mark.parametrize("slots", [2, 4])
def test_admitted_episodes_equal_those_of_one_full_batch(torch_engine, codec, slots):
    """Greedy: an episode admitted into a freed slot mid-flight is token for token the episode of the batch that
    decodes every row at once (and so of the row run alone: ``test_rows_finish_independently_of_the_batch``).
    4 slots: the first admission prefills two prompts in one forward, a later one the third."""
    full, _, _ = run_slots(torch_engine, codec, 0, greedy=True)
    queued, stats, _ = run_slots(torch_engine, codec, slots, greedy=True)
    assert stats.extra["admitted"] == 9 - slots and len({len(e.tokens) for g in full for e in g}) > 1
    for a, b in zip((e for g in full for e in g), (e for g in queued for e in g), strict=True):
        assert (a.tokens, a.roles, a.turn_starts, a.calls, a.end_reason) == (
            b.tokens, b.roles, b.turn_starts, b.calls, b.end_reason)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=TOL)


def test_rows_waiting_for_their_tools_keep_their_slots(torch_engine, codec):
    """refill_share 1: paused rows wait until as many wait as decode; they hold their slots meanwhile, so rows
    decoding plus rows waiting never exceed the slots, and every episode still ends."""
    torch_engine.refill_share = 1.0
    try:
        groups, stats, driver = run_slots(torch_engine, codec, 4, seed=3)
    finally:
        torch_engine.refill_share = 0.0
    assert stats.extra["admitted"] == 5 and max(driver.held) == 4
    assert any(held > rows for held, (rows, _) in zip(driver.held, driver.steps, strict=True))  # rows did wait
    assert all(e.end_reason for g in groups for e in g)


def test_admitted_episodes_logprobs_equal_a_full_forward_recompute(torch_engine, codec):
    groups, stats, _ = run_slots(torch_engine, codec, 4, seed=4)
    assert stats.extra["admitted"] >= 1 and stats.extra["refills"] >= 1
    worst = 0.0
    for prompt, group in zip(prompts_of(codec, QUESTIONS), groups, strict=True):
        for e in group:
            with torch.no_grad():
                logits = torch_engine.model(input_ids=torch.tensor([prompt + e.tokens])).logits[0]
            lp = sampling_logprobs_torch(logits[len(prompt) - 1:-1], 0.9, 1.0)
            ref = lp.gather(-1, torch.tensor(e.tokens)[:, None])[:, 0].numpy()
            act = np.array(e.roles) == ROLE_ACTION
            worst = max(worst, float(np.abs(ref[act] - np.array(e.logprobs)[act]).max()))
    assert worst < TOL, f"admitted rows' logprobs drift from the recompute: max |d| {worst:.2e}"


def test_each_prompt_is_prefilled_once_though_its_rows_are_admitted_apart(torch_engine, codec, monkeypatch):
    """4 slots, 3 rows a prompt: prompt 1's rows are admitted over two calls; every prompt is prefilled once."""
    prefilled: list[int] = []
    real = torch_engine._prefill

    def spy(prompts, n):
        prefilled.extend(len(p) for p in prompts)
        return real(prompts, n)

    monkeypatch.setattr(torch_engine, "_prefill", spy)
    run_slots(torch_engine, codec, 4)
    assert sorted(prefilled) == sorted(len(p) for p in prompts_of(codec, QUESTIONS))


def test_a_negative_slot_count_is_refused(torch_engine, codec):
    with pytest.raises(ValueError, match="decode_slots"):
        run_slots(torch_engine, codec, -1)
