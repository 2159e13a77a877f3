"""The torch engine on every tiny family (qwen3, MoE, lfm2 convolutions, qwen3.5 gated-delta hybrids): recorded
logprobs equal a transformers fp32 full forward of each row alone, so left padding never leaks into a conv or
recurrent state and finished rows drop out of every layer kind; multi-turn episodes pass the same gate, and the
trainer's replay accepts them on each family's tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stoa.engines.torch import TorchEngine, sampling_logprobs_torch
from stoa.episodes.collect import episode_sample
from stoa.episodes.driver import EpisodeDriver
from stoa.episodes.replay import replay_group
from stoa.rollouts.episode import ROLE_ACTION
from stoa.tokenize import TextCodec
from tests.engines.test_torch_episodes import LIMITS, QUESTIONS, LetterEnv, RecordingTools, prompts_of

FAMILIES = ("tiny-qwen3", "tiny-qwen3-moe", "tiny-lfm2", "tiny-lfm2-moe", "tiny-qwen3.5", "tiny-qwen3.5-moe")
HYBRIDS = ("tiny-lfm2", "tiny-lfm2-moe", "tiny-qwen3.5", "tiny-qwen3.5-moe")
TOL = 1e-5  # the fp32 worker-vs-trainer gate
RNG = np.random.default_rng(3)
#: A 70-token prompt (past qwen3.5's 64-token gated-delta chunk) next to short ones: up to 66 pad tokens per row.
PROMPTS = [RNG.integers(3, 500, 70).tolist(), [5, 9, 14, 20], [7]]
EOS = tuple(range(3, 40))  # ~7% of the tiny vocabulary: rows end at different steps and leave the batch


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, stoa_cache: Path) -> tuple[str, Path, TorchEngine, Any]:
    """A family's directory, an fp32 engine on it and an independent transformers model (the reference)."""
    from transformers import AutoModelForCausalLM

    from stoa.models import resolve_model

    model_dir = resolve_model(request.param, cache_dir=stoa_cache)
    ref: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return request.param, model_dir, TorchEngine(model_dir, device="cpu"), ref


def alone_logprobs(ref: Any, prompt: list[int], tokens: list[int], temperature: float, top_p: float) -> np.ndarray:
    """The sampling distribution's logprobs of ``tokens`` after ``prompt``: one unpadded full forward at batch 1."""
    with torch.no_grad():
        logits = ref(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    lp = sampling_logprobs_torch(logits, temperature, top_p)
    return lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].numpy()


def test_recorded_logprobs_equal_each_row_scored_alone(family):
    name, _, eng, ref = family
    groups, _ = eng.generate(PROMPTS, 3, max_new_tokens=12, temperature=0.8, top_p=0.9, eos_ids=EOS,
                             generator=eng.make_generator(11))
    lengths = {len(c.tokens) for g in groups for c in g}
    assert len(lengths) > 1 and min(lengths) < 12  # rows really finished early and left the batch
    worst = max(float(np.abs(alone_logprobs(ref, p, c.tokens, 0.8, 0.9) - np.array(c.logprobs)).max())
                for p, g in zip(PROMPTS, groups, strict=True) for c in g)
    assert worst < TOL, f"{name}: recorded logprobs drift from the fp32 full forward: max |d| {worst:.2e}"


def test_a_left_padded_row_decodes_as_it_does_alone(family):
    """Greedy rows next to a 70-token prompt (66 pad tokens before the shortest) equal the same prompt run alone."""
    name, _, eng, _ = family
    together, _ = eng.generate(PROMPTS, 1, max_new_tokens=10, greedy=True)
    for p, g in zip(PROMPTS, together, strict=True):
        (alone,), _ = eng.generate([p], 1, max_new_tokens=10, greedy=True)
        assert alone[0].tokens == g[0].tokens, name
        np.testing.assert_allclose(alone[0].logprobs, g[0].logprobs, atol=TOL)


@pytest.mark.parametrize("name", HYBRIDS)
def test_multi_turn_episodes_on_hybrids_equal_a_full_forward(name: str, stoa_cache: Path):
    """Paused rows leave the batch with their conv / recurrent states, are fed alone and merge back."""
    from transformers import AutoModelForCausalLM

    from stoa.models import resolve_model

    model_dir = resolve_model(name, cache_dir=stoa_cache)
    eng, codec = TorchEngine(model_dir, device="cpu"), TextCodec(model_dir)
    ref: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = prompts_of(codec, QUESTIONS)
    driver = EpisodeDriver([LetterEnv() for _ in range(len(prompts) * 2)], RecordingTools(), codec, LIMITS,
                           codec.eos_ids)
    groups, stats = eng.generate_episodes(prompts, 2, driver, temperature=0.9, generator=eng.make_generator(1))
    eps = [e for g in groups for e in g]
    assert max(len(e.turn_starts) for e in eps) >= 2 and stats.extra["rounds"] >= 2  # rows really resumed
    worst = 0.0
    for prompt, group in zip(prompts, groups, strict=True):
        for e in group:
            act = np.array(e.roles) == ROLE_ACTION
            d = alone_logprobs(ref, prompt, e.tokens, 0.9, 1.0)[act] - np.array(e.logprobs)[act]
            worst = max(worst, float(np.abs(d).max()))
    assert worst < TOL, f"{name}: multi-turn logprobs drift from the recompute: max |d| {worst:.2e}"
    # The trainer's replay re-derives the same turn ends on this family's tokenizer: every episode is accepted.
    samples = [episode_sample(e, 0.0) for e in eps]
    out = replay_group([LetterEnv() for _ in samples], samples, RecordingTools(), codec, LIMITS, codec.eos_ids)
    assert [r.calls for r in out] == [len(e.calls) for e in eps]
