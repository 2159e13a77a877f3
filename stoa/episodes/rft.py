"""Rejection sampling (RFT/STaR) for a cold start: the policy's own correct samples as training rows.

``rejection_sample`` draws ``samples`` completions (single-turn: ``engine.generate``) or episodes (multi-turn:
``sample_episodes``, with the caller's tools) of each training prompt at the run's temperature, judges each
with the task's ``is_correct`` on the policy's own text (as the held-out evaluation does: the decoded
completion, or ``episode_text``), and keeps the first correct one of each prompt as an ``SftRow``: its prompt
ids and tokens and roles exactly as sampled, never re-tokenised. It stops once ``examples`` rows are kept or
``max_prompts`` prompts were tried. Engine-free (no torch, no mlx): the engine comes in as an argument, so the
fleet trainer and local mode can share it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from stoa.episodes.collect import sample_episodes
from stoa.episodes.demo_rows import SftRow
from stoa.rollouts.episode import ROLE_ACTION
from stoa.tasks.base import Prompt, RewardError
from stoa.tasks.multiturn import is_multiturn
from stoa.tasks.scoring import judge

__all__ = ["RFT_PROMPTS_PER_EXAMPLE", "RFT_ROWS_PER_CALL", "RftProgress", "RftResult", "rejection_sample"]

RFT_PROMPTS_PER_EXAMPLE = 4
"""The prompt cap: at most ``examples`` x this many training prompts are tried."""
RFT_ROWS_PER_CALL = 64
"""Samples per engine call (prompts per call: this // ``samples``, at least one)."""


class RftProgress(NamedTuple):
    """Where rejection sampling stands (after each engine call)."""

    kept: int
    """Rows kept so far (one per prompt at most)."""
    tried: int
    """Samples drawn so far."""
    prompts: int
    """Prompts tried so far."""


class RftResult(NamedTuple):
    """The kept rows and what it took."""

    rows: list[SftRow]
    """At most ``examples`` rows, in the order their prompts were drawn."""
    tried: int
    """Samples drawn (completions or episodes)."""
    prompts: int
    """Training prompts tried."""


class _Draw(NamedTuple):
    """One engine call's samples: per prompt its prompt ids and, per sample, (tokens, roles, text)."""

    prompt_ids: list[list[int]]
    samples: list[list[tuple[Sequence[int], Sequence[int], str]]]


def rejection_sample(engine: Any, task: Any, codec: Any, tools: Any, *, examples: int, samples: int,
                     max_new_tokens: int, temperature: float, top_p: float, seed: int, max_prompts: int = 0,
                     note: Callable[[RftProgress], Any] | None = None) -> RftResult:
    """The first correct sample of each training prompt as a row, until ``examples`` are kept.

    Args:
        engine: the engine to sample with (``generate``; ``generate_episodes`` for a multi-turn task).
        task: the run's task (``sample_train``, ``is_correct``).
        codec: the run's ``TextCodec``.
        tools: a multi-turn task's tools (None: single-turn).
        examples: rows to keep.
        samples: samples per prompt.
        max_new_tokens: tokens of a completion (of each model turn in an episode).
        temperature: sampling temperature.
        top_p: nucleus mass.
        seed: seeds the training prompts (``task.sample_train``) and the engine's generator.
        max_prompts: the prompt cap (0: ``examples`` x ``RFT_PROMPTS_PER_EXAMPLE``).
        note: called after each engine call with the progress.
    """
    rng, generator = np.random.default_rng(seed), engine.make_generator(seed)
    cap = max_prompts or examples * RFT_PROMPTS_PER_EXAMPLE
    per_call = max(1, RFT_ROWS_PER_CALL // samples)
    rows: list[SftRow] = []
    tried = done = 0
    while len(rows) < examples and done < cap:
        prompts = [task.sample_train(rng) for _ in range(min(per_call, cap - done))]
        draw = _draw(engine, task, codec, tools, prompts, samples, max_new_tokens, temperature, top_p, generator)
        for p, ids, group in zip(prompts, draw.prompt_ids, draw.samples, strict=True):
            tried += len(group)
            ok = next(((t, r) for t, r, text in group if _correct(task, p, text)), None)
            if ok is not None and len(rows) < examples:
                rows.append(SftRow(np.asarray(ids, np.int32), np.asarray(ok[0], np.int32), np.asarray(ok[1], np.int8)))
        done += len(prompts)
        if note is not None:
            note(RftProgress(len(rows), tried, done))
    return RftResult(rows, tried, done)


def _draw(engine: Any, task: Any, codec: Any, tools: Any, prompts: list[Prompt], samples: int,
          max_new_tokens: int, temperature: float, top_p: float, generator: Any) -> _Draw:
    """``samples`` completions or episodes of each prompt, as tokens, roles and the text the task judges."""
    if is_multiturn(task):
        eb = sample_episodes(engine, task, codec, tools, prompts, samples, max_turn_tokens=max_new_tokens,
                             temperature=temperature, top_p=top_p, generator=generator)
        return _Draw(eb.prompt_tokens, [[(e.tokens, e.roles, text) for e, text in zip(g, texts, strict=True)]
                                        for g, texts in zip(eb.groups, eb.texts, strict=True)])
    ids = [codec.encode_prompt(p.messages) for p in prompts]
    groups, _ = engine.generate(ids, samples, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                eos_ids=codec.eos_ids, generator=generator)
    return _Draw(ids, [[(c.tokens, [ROLE_ACTION] * len(c.tokens), codec.decode(c.tokens)) for c in g]
                       for g in groups])


def _correct(task: Any, prompt: Prompt, text: str) -> bool:
    """The task's verdict on one sample (a verifier that fails on it: not correct)."""
    try:
        return judge(task, prompt, text)
    except RewardError:
        return False
