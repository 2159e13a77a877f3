"""Multi-turn episodes on the MLX engine: decode rounds, paused rows' caches, observations fed at batch 1.

A round decodes the batch until no row decodes (each row ended or paused, as ``EpisodeDriver.record``
says). A paused row's KV leaves the batch as its own single-row ``KVCache`` (``take_row``, without the left
padding). At the round boundary ``EpisodeDriver.resume`` runs the tools of every paused row in one request;
each row that goes on is fed ``[its last sampled token] + observation tokens`` at batch 1 (``feed``),
and the resumed rows' caches merge into one left-padded ``BatchKVCache`` for the next round. Every row's
positions stay contiguous (prompt, then every token), so a full forward of prompt + episode recomputes the
recorded logprobs. Conv / linear-attention layers cannot drop a token, so a paused row's state is the
snapshot from before the step that fed its last token (``caches.snapshot``), fed again like the KV layers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import mlx.core as mx

from stoa.engines.base import GenStats
from stoa.engines.mlx.caches import cache_arrays, snapshot
from stoa.engines.mlx.kv import compact, feed, merge_rows, take_row
from stoa.engines.mlx.sampling import Draw
from stoa.episodes.driver import EpisodeDriver

Sampler = Callable[[mx.array, mx.array | None], Draw]
"""``draw`` with the call's temperature, top-p and greedy bound: (logits, key) -> Draw."""


class PausedRow(NamedTuple):
    """A paused row's KV, kept aside while the batch decodes on."""

    cache: list[Any]
    """Per layer, the row's single-row ``KVCache`` up to (not including) its last sampled token."""
    last: int
    """Its last sampled token, fed first when the row resumes."""


class Batch(NamedTuple):
    """The rows decoding in one round and the draw from their last logits."""

    cache: list[Any]
    """Per layer, the rows' ``BatchKVCache``."""
    active: list[int]
    """Row numbers, in batch order."""
    first: Draw
    """The next token of each row (sampled, not fed yet)."""


def decode_round(model: Any, batch: Batch, sample: Sampler, driver: EpisodeDriver,
                 stats: GenStats) -> tuple[dict[int, PausedRow], mx.array | None]:
    """Decode until no row of the batch decodes; keep the caches of the rows that paused.

    Each step queues the next forward and draw before reading its own tokens (as ``MLXEngine._decode``);
    the queued forward has fed the rows that stop at this step too, so a paused row's cache is taken
    without that last position (it is fed again with the observation).

    Args:
        model: the mlx-lm model.
        batch: the rows, their cache (filtered in place) and first draw.
        sample: the step's draw.
        driver: records each token and says which rows go on.
        stats: receives steps and new tokens.

    Returns:
        row -> its paused cache, for the rows that paused; and the key the next draw uses.
    """
    cache, active, cur = batch
    paused: dict[int, PausedRow] = {}
    while True:
        before = snapshot(cache)
        nxt = sample(model(cur.tokens[:, None], cache=cache)[:, -1, :], cur.key)
        mx.async_eval(nxt.tokens, nxt.logprobs)
        tokens = cast(list, cur.tokens.tolist())
        keep = driver.record(active, tokens, cast(list, cur.logprobs.tolist()))
        stats.steps += 1
        stats.new_tokens += len(active)
        if len(keep) < len(active):
            waiting, kept = set(driver.paused), set(keep)
            for i, r in enumerate(active):
                if i not in kept and r in waiting:
                    paused[r] = PausedRow(take_row(cache, i, drop_last=1, before=before), int(tokens[i]))
        if not keep:
            return paused, nxt.key
        if len(keep) < len(active):
            active, nxt = compact(cache, active, keep, nxt)
        cur = nxt


def resume_batch(model: Any, paused: dict[int, PausedRow], observations: dict[int, list[int]],
                 vocab_size: int, chunk: int, sample: Sampler, key: mx.array | None, stats: GenStats) -> Batch:
    """Feed each resumed row its last token and observation at batch 1, then merge the rows into a batch.

    Args:
        model: the mlx-lm model.
        paused: the paused rows' caches (``decode_round``).
        observations: row -> observation tokens, for the rows that go on (``EpisodeDriver.resume``).
        vocab_size: rows of the model's output projection (observation ids must be below it).
        chunk: tokens per forward.
        sample: the step's draw.
        key: the key the draw uses.
        stats: receives ``extra["obs_prefill_tokens"]`` and ``extra["obs_prefill_s"]``.

    Returns:
        the resumed rows in row order, their merged cache and the draw from their last logits.
    """
    t0 = time.perf_counter()
    rows = sorted(observations)
    missing = [r for r in rows if r not in paused]
    if missing:
        raise ValueError(f"observations for row {missing[0]}: the row did not pause in this round")
    logits = []
    for r in rows:
        obs = [int(t) for t in observations[r]]
        bad = [t for t in obs if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"observation of row {r}: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        logits.append(feed(model, paused[r].cache, [paused[r].last, *obs], chunk))
        stats.extra["obs_prefill_tokens"] = stats.extra.get("obs_prefill_tokens", 0.0) + 1 + len(obs)
    layers = len(paused[rows[0]].cache)
    cache = [merge_rows([paused[r].cache[layer] for r in rows]) for layer in range(layers)]
    first = sample(mx.concatenate(logits, axis=0), key)
    mx.eval(first.tokens, first.logprobs, cache_arrays(cache))
    stats.extra["obs_prefill_s"] = stats.extra.get("obs_prefill_s", 0.0) + time.perf_counter() - t0
    return Batch(cache, rows, first)


def run_rounds(model: Any, batch: Batch, sample: Sampler, driver: EpisodeDriver, vocab_size: int, chunk: int,
               stats: GenStats) -> None:
    """Decode rounds and resume paused rows until every episode has ended.

    Args:
        model: the mlx-lm model.
        batch: every row after the prompts' prefill.
        sample: the step's draw.
        driver: the episodes (ends and pauses rows, runs the tools).
        vocab_size: rows of the model's output projection.
        chunk: tokens per observation forward.
        stats: receives ``decode_s``, steps, new tokens and ``extra``: ``rounds``, ``resume_s`` (tools and
            observation building), ``obs_prefill_tokens``, ``obs_prefill_s``.

    Raises:
        ToolUnavailable: the tools could not answer (from ``driver.resume``; the episodes are unfinished).
    """
    stats.extra.update(rounds=0.0, resume_s=0.0, obs_prefill_tokens=0.0, obs_prefill_s=0.0)
    while True:
        t0 = time.perf_counter()
        paused, key = decode_round(model, batch, sample, driver, stats)
        stats.decode_s += time.perf_counter() - t0
        stats.extra["rounds"] += 1
        if not paused:
            return
        t1 = time.perf_counter()
        observations = driver.resume()
        stats.extra["resume_s"] += time.perf_counter() - t1
        if not observations:
            return
        batch = resume_batch(model, paused, observations, vocab_size, chunk, sample, key, stats)


def check_driver(driver: EpisodeDriver, prompts: Sequence[Sequence[int]], n: int) -> None:
    """Refuse a driver whose rows are not the prompts x samples of the call (ValueError naming both)."""
    if driver.rows != len(prompts) * n:
        raise ValueError(f"driver: it holds {driver.rows} rows, the call makes {len(prompts)} prompts x n={n}; "
                         "build it with one environment per row")
    if driver.decoding != list(range(driver.rows)):
        raise ValueError("driver: every row must be decoding its first turn (use a new driver per call)")
