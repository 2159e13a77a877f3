"""Multi-turn episodes on the MLX engine: decode rounds, paused rows' caches, observations fed in one forward.

A round decodes the batch until no row decodes (each row ended or paused, as ``EpisodeDriver.record``
says). A paused row's KV leaves the batch as its own single-row ``KVCache`` (``take_row``, without the left
padding). At the round boundary ``EpisodeDriver.resume`` runs the tools of every paused row in one request;
the rows that go on are fed ``[last sampled token] + observation tokens`` in one forward (``feed_together``;
a hybrid's rows at batch 1, ``feed``), and the resumed rows' caches form one left-padded ``BatchKVCache``. Every row's
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
from stoa.engines.mlx.caches import cache_arrays, has_state, snapshot
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


Refill = Callable[[dict[int, PausedRow], mx.array | None], Batch | None]
"""Paused rows and the next draw's key -> the resumed rows as a batch (their tools run, observations fed), or None
when every paused row ended."""

Admit = Callable[[int, mx.array | None], Batch | None]
"""Rows held (decoding or paused) and the next draw's key -> queued rows admitted into the free decode slots, their
prompts prefilled and first token drawn (``mlx.slots.admit``), or None when none is admitted."""


def join(cache: list[Any], active: list[int], nxt: Draw, resumed: Batch) -> tuple[list[int], Draw]:
    """Append resumed rows to a decoding batch: their KV after its rows (``BatchKVCache.extend`` aligns the
    lengths with left padding), their first draw after its queued draw; the next key is the resumed draw's."""
    for c, r in zip(cache, resumed.cache, strict=True):
        c.extend(r)
    first = resumed.first
    return active + resumed.active, Draw(mx.concatenate([nxt.tokens, first.tokens]),
                                         mx.concatenate([nxt.logprobs, first.logprobs]), first.key)


def decode_round(model: Any, batch: Batch, sample: Sampler, driver: EpisodeDriver, stats: GenStats,
                 refill: Refill | None = None,
                 admit: Admit | None = None) -> tuple[dict[int, PausedRow], mx.array | None]:
    """Decode until no row of the batch decodes; keep the caches of the rows that paused.

    Each step queues the next forward and draw before reading its own tokens (as ``MLXEngine._decode``);
    the queued forward has fed the rows that stop at this step too, so a paused row's cache is taken
    without that last position (it is fed again with the observation). With ``refill``, rows that pause while
    others decode are resumed at once and join the batch before the next step; with ``admit``, queued rows take the
    slots of rows that ended (both attention-only models).

    Args:
        model: the mlx-lm model.
        batch: the rows, their cache (filtered in place) and first draw.
        sample: the step's draw.
        driver: records each token and says which rows go on.
        stats: receives steps and new tokens (``extra["refills"]``: resumes while rows decoded).
        refill: resumes paused rows (tools and observation feed); None keeps them until no row decodes.
        admit: admits queued rows into free slots after every step; None admits none.

    Returns:
        row -> its paused cache, for the rows that paused (after the last row stopped); and the key the next
        draw uses.
    """
    cache, active, cur = batch
    if has_state(cache):
        refill = admit = None  # a state layer has no extend: hybrids resume between rounds
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
        if paused and refill is not None:
            stats.extra["refills"] = stats.extra.get("refills", 0.0) + 1
            resumed = refill(paused, nxt.key)
            paused = {}
            if resumed is not None:
                active, nxt = join(cache, active, nxt, resumed)
        new = admit(len(active) + len(paused), nxt.key) if admit is not None else None
        if new is not None:
            active, nxt = join(cache, active, nxt, new)
        cur = nxt


History = Callable[[int], list[int]]
"""Row -> its prompt followed by every episode token so far (what its cache holds, then ``[last] + observation``)."""


def feed_together(model: Any, paused: dict[int, PausedRow], seqs: dict[int, list[int]], history: History,
                  chunk: int) -> tuple[list[Any], mx.array] | None:
    """Feed every resumed row its tokens in ONE forward; None when a row cannot take part (then feed at batch 1).

    ``BatchKVCache`` hides only left padding, so every row's fed sequence must end at the batch's last column
    with no gap: a row with fewer tokens than the longest gives its cache's last positions back and feeds those
    tokens again before its own (the same keys and values, recomputed). Hybrids (a state cannot give tokens
    back) and rows whose cache is shorter than what they would give back return None.

    Args:
        model: the mlx-lm model.
        paused: the paused rows' caches.
        seqs: row -> ``[last token] + observation`` (row order).
        history: row -> prompt + episode tokens.
        chunk: tokens per forward.

    Returns:
        the merged per-layer cache after the feed and the ``[rows, V]`` logits; or None.
    """
    from mlx_lm.models.cache import KVCache

    rows, width = sorted(seqs), max(len(t) for t in seqs.values())
    if any(has_state(paused[r].cache) for r in rows):
        return None
    caches, inputs = [], []
    for r in rows:
        back, length = width - len(seqs[r]), paused[r].cache[0].offset
        if back >= length:
            return None
        cut = []
        for c in paused[r].cache:  # merge_rows reads keys/values up to offset: a shorter offset gives them back
            t = KVCache()
            t.keys, t.values, t.offset = c.keys, c.values, c.offset - back
            cut.append(t)
        caches.append(cut)
        inputs.append(history(r)[length - back:length] + seqs[r])
    cache = [merge_rows([c[layer] for c in caches]) for layer in range(len(caches[0]))]
    return cache, feed(model, cache, mx.array(inputs, dtype=mx.int32), chunk)


def resume_batch(model: Any, paused: dict[int, PausedRow], observations: dict[int, list[int]],
                 vocab_size: int, chunk: int, sample: Sampler, key: mx.array | None, stats: GenStats,
                 history: History | None = None) -> Batch:
    """Feed the resumed rows their last token and observation (in one forward when ``history`` is given and
    ``feed_together`` can, else each at batch 1), as one merged batch.

    Args:
        model: the mlx-lm model.
        paused: the paused rows' caches (``decode_round``).
        observations: row -> observation tokens, for the rows that go on (``EpisodeDriver.resume``).
        vocab_size: rows of the model's output projection (observation ids must be below it).
        chunk: tokens per forward.
        sample: the step's draw.
        key: the key the draw uses.
        stats: ``extra``: ``obs_prefill_tokens``, ``obs_prefill_s``, ``obs_prefill_batched`` (rounds fed in one
            forward) and ``obs_prefill_refed`` (cached tokens fed again to line the rows up) grow.
        history: row -> prompt + episode tokens (None: feed each row at batch 1).

    Returns:
        the resumed rows in row order, their merged cache and the draw from their last logits.
    """
    t0 = time.perf_counter()
    rows = sorted(observations)
    missing = [r for r in rows if r not in paused]
    if missing:
        raise ValueError(f"observations for row {missing[0]}: the row did not pause in this round")
    seqs = {r: [paused[r].last, *[int(t) for t in observations[r]]] for r in rows}
    for r in rows:
        bad = [t for t in seqs[r][1:] if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"observation of row {r}: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        stats.extra["obs_prefill_tokens"] = stats.extra.get("obs_prefill_tokens", 0.0) + len(seqs[r])
    together = feed_together(model, paused, seqs, history, chunk) if history is not None else None
    if together is None:
        logits = mx.concatenate([feed(model, paused[r].cache, seqs[r], chunk) for r in rows], axis=0)
        cache = [merge_rows([paused[r].cache[layer] for r in rows]) for layer in range(len(paused[rows[0]].cache))]
    else:
        cache, logits = together
        width = max(len(t) for t in seqs.values())
        stats.extra["obs_prefill_batched"] = stats.extra.get("obs_prefill_batched", 0.0) + 1
        stats.extra["obs_prefill_refed"] = stats.extra.get("obs_prefill_refed", 0.0) + sum(
            width - len(t) for t in seqs.values())
    first = sample(logits, key)
    mx.eval(first.tokens, first.logprobs, cache_arrays(cache))
    stats.extra["obs_prefill_s"] = stats.extra.get("obs_prefill_s", 0.0) + time.perf_counter() - t0
    return Batch(cache, rows, first)


def run_rounds(model: Any, batch: Batch | None, sample: Sampler, driver: EpisodeDriver, vocab_size: int, chunk: int,
               stats: GenStats, history: History | None = None, refill: bool = False, admit: Admit | None = None,
               key: mx.array | None = None) -> None:
    """Decode rounds, resume paused rows and admit queued ones until every episode has ended.

    Args:
        model: the mlx-lm model.
        batch: every row after the prompts' prefill; None with ``admit`` (the queue's first rows start).
        sample: the step's draw.
        driver: the episodes (ends and pauses rows, runs the tools).
        vocab_size: rows of the model's output projection.
        chunk: tokens per observation forward.
        stats: receives ``decode_s``, steps, new tokens and ``extra``: ``rounds``, ``resume_s`` (tools and
            observation building), ``obs_prefill_tokens``, ``obs_prefill_s``, ``obs_prefill_batched``,
            ``obs_prefill_refed``.
        history: row -> prompt + episode tokens, to feed each round's resumed rows in one forward (None: each
            at batch 1).
        refill: resume rows that pause while others decode before the next step (``decode_round``; ``refills``
            counts those resumes, ``resume_s`` and ``obs_prefill_s`` their time, which ``decode_s`` leaves out).
        admit: continuous batching: queued rows take free slots after every step and at every round's start (a
            hybrid's only once no row is left: a state layer cannot join a batch); ``decode_s`` leaves out
            ``admit_prefill_s``.
        key: the first admitted rows' draw key (with ``admit``).

    Raises:
        ToolUnavailable: the tools could not answer (from ``driver.resume``; the episodes are unfinished).
    """
    stats.extra.update(rounds=0.0, resume_s=0.0, obs_prefill_tokens=0.0, obs_prefill_s=0.0,
                       obs_prefill_batched=0.0, obs_prefill_refed=0.0, refills=0.0)

    def resume(paused: dict[int, PausedRow], key: mx.array | None) -> Batch | None:
        t1 = time.perf_counter()
        observations = driver.resume()
        stats.extra["resume_s"] += time.perf_counter() - t1
        if not observations:
            return None
        return resume_batch(model, paused, observations, vocab_size, chunk, sample, key, stats, history)

    def aside() -> float:
        return stats.extra["resume_s"] + stats.extra["obs_prefill_s"] + stats.extra.get("admit_prefill_s", 0.0)

    while True:
        if admit is not None:
            batch = top_up(batch, admit, key)
        if batch is None:
            return
        t0, before = time.perf_counter(), aside()
        paused, key = decode_round(model, batch, sample, driver, stats, resume if refill else None, admit)
        stats.decode_s += time.perf_counter() - t0 - (aside() - before)
        stats.extra["rounds"] += 1
        batch = resume(paused, key) if paused else None


def top_up(batch: Batch | None, admit: Admit, key: mx.array | None) -> Batch | None:
    """A round's batch with queued rows in its free slots (a hybrid's only when no row is left); None if empty."""
    if batch is not None and has_state(batch.cache):
        return batch
    new = admit(len(batch.active) if batch is not None else 0, batch.first.key if batch is not None else key)
    if new is None or batch is None:
        return batch if new is None else new
    active, first = join(batch.cache, batch.active, batch.first, new)
    return Batch(batch.cache, active, first)


def check_driver(driver: EpisodeDriver, prompts: Sequence[Sequence[int]], n: int) -> None:
    """Refuse a driver whose rows are not the prompts x samples of the call (ValueError naming both)."""
    if driver.rows != len(prompts) * n:
        raise ValueError(f"driver: it holds {driver.rows} rows, the call makes {len(prompts)} prompts x n={n}; "
                         "build it with one environment per row")
    if driver.decoding != list(range(driver.rows)):
        raise ValueError("driver: every row must be decoding its first turn (use a new driver per call)")
