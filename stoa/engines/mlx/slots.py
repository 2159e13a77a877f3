"""Continuous batching of episodes on the MLX engine: queued rows prefilled and joined into freed decode slots.

The queue is ``stoa.engines.slots.RowQueue``; here are the MLX engine's prefill (each prompt alone at batch 1, as
``MLXEngine._prefill_groups``: no pad token ever enters a state layer) and merge (``kv.merge_rows``: a left-padded
``BatchKVCache``; the prompt's cache is read, never changed, so later rows of the prompt merge it again). The
admitted rows' first draw comes from their prompt's logits; ``rounds.join`` appends them to the decoding batch
(``BatchKVCache.extend``), as it does resumed rows.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import mlx.core as mx

from stoa.engines.base import GenStats
from stoa.engines.mlx.caches import cache_arrays
from stoa.engines.mlx.kv import merge_rows
from stoa.engines.mlx.rounds import Batch, Sampler
from stoa.engines.slots import RowQueue, admit_timed


class Prefilled(NamedTuple):
    """One prompt after its prefill at batch 1."""

    cache: list[Any]
    """Per layer, the prompt's ``KVCache`` / ``ArraysCache``."""
    logits: mx.array
    """``[1, V]`` logits after its last token."""


class Admitted(NamedTuple):
    """Queued rows merged into one batch, before their first draw."""

    cache: list[Any]
    """Per layer, the rows' merged cache."""
    active: list[int]
    """Row numbers, in row order."""
    logits: mx.array
    """``[rows, V]`` logits of each row's prompt."""


def row_queue(engine: Any, prompts: Sequence[Sequence[int]], n: int,
              stats: GenStats) -> RowQueue[Prefilled, Admitted]:
    """The queue of the call's ``len(prompts) * n`` episodes on ``engine`` (an ``MLXEngine``); ``stats``'s
    ``extra["prompt_tokens"]`` grows by each prompt's tokens when it is prefilled."""

    def prefill(batch: list[Sequence[int]]) -> list[Prefilled]:
        out = [Prefilled(*engine._prefill(p, 1)) for p in batch]
        mx.eval([p.logits for p in out], [cache_arrays(p.cache) for p in out])
        stats.extra["prompt_tokens"] = stats.extra.get("prompt_tokens", 0.0) + sum(len(p) for p in batch)
        return out

    return RowQueue(prompts, n, prefill, merge)


def merge(rows: dict[int, Prefilled]) -> Admitted:
    """The rows (row -> its prompt's state, row order) as one batch; the states stay as they were."""
    states = list(rows.values())
    cache = [merge_rows([s.cache[layer] for s in states]) for layer in range(len(states[0].cache))]
    return Admitted(cache, list(rows), mx.concatenate([s.logits for s in states], axis=0))


def admit(queue: RowQueue[Prefilled, Admitted], slots: int, sample: Sampler, stats: GenStats, held: int,
          key: mx.array | None) -> Batch | None:
    """Queued rows for the slots that ``held`` rows (decoding or waiting for a tool) leave free, with their first
    draw (``key``); None when no slot is free or no row waits.

    Args:
        queue: the episodes waiting.
        slots: the most rows decoding or waiting at once.
        sample: the step's draw.
        stats: ``prefill_s``, ``admit_prefill_s`` and ``admitted`` grow (``slots.admit_timed``).
        held: rows decoding or paused now.
        key: the key the admitted rows' draw uses.
    """
    new = admit_timed(queue, slots - held, stats)
    if new is None:
        return None
    t0 = time.perf_counter()
    first = sample(new.logits, key)
    mx.eval(first.tokens, first.logprobs, cache_arrays(new.cache))
    took = time.perf_counter() - t0  # the merge ran lazily: its time is here
    stats.prefill_s += took
    stats.extra["admit_prefill_s"] += took
    return Batch(new.cache, new.active, first)
