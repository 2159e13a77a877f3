"""The cache kinds the MLX engine batches: attention KV and fixed-size recurrent state (conv / linear attention).

mlx-lm gives each layer one cache from ``make_prompt_cache``: ``KVCache`` for attention (grows by one position
per token; merged into a left-padded ``BatchKVCache``, ``stoa.engines.mlx.kv``) or ``ArraysCache`` for layers
that carry a fixed-size state instead (lfm2's short convolution: one array, the last ``K - 1`` inputs;
qwen3.5's gated delta net: the conv inputs and the recurrent matrix). A state row has no positions, so it has
no padding either: the engine feeds every prompt (and every resumed episode row) alone at batch 1, or as n
identical copies, so no pad token ever enters a state, and a merged batch of states is their rows stacked
(no ``left_padding`` or ``lengths`` is set, so mlx-lm's ssm mask stays None). Only the attention layers see
the batch's left padding, which ``BatchKVCache``'s mask hides. mlx-lm's own ``ArraysCache.filter`` drops
finished rows.

A state cannot give back its last token the way a KV cache drops its last position, so a paused episode row
(``kv.take_row(drop_last=1)``) takes its state from a :func:`snapshot` made before the step's forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

SUPPORTED_KINDS = ("KVCache", "ArraysCache")
"""mlx-lm cache classes the engine batches (rotating, chunked and quantized KV caches are not among them)."""

Snapshot = list[list[Any] | None]
"""Per layer, the arrays an ``ArraysCache`` held before a forward (None for KV layers)."""


def check_cache_kinds(model: Any, model_type: object) -> None:
    """Refuse a model whose ``make_prompt_cache`` holds a cache class the engine cannot batch (ValueError)."""
    from mlx_lm.models.cache import make_prompt_cache

    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model)} - set(SUPPORTED_KINDS))
    if kinds:
        raise ValueError(f"{model_type!r} models use {', '.join(kinds)} caches; the MLX engine batches "
                         f"{' and '.join(SUPPORTED_KINDS)} layers only (use the torch engine for this model)")


def is_state(cache: Any) -> bool:
    """True for a fixed-size state cache (``ArraysCache``: conv or linear-attention layers)."""
    from mlx_lm.models.cache import ArraysCache

    return isinstance(cache, ArraysCache)


def has_state(cache: Sequence[Any]) -> bool:
    """True when any layer of ``cache`` holds a fixed-size state (a hybrid model)."""
    return any(is_state(c) for c in cache)


def cache_arrays(cache: Sequence[Any]) -> list[mx.array]:
    """Every array the per-layer caches hold, for ``mx.eval`` (``ArraysCache.state`` holds Nones)."""
    out: list[mx.array] = []
    for c in cache:
        if is_state(c):
            out += [a for a in c.cache if a is not None]
        else:
            out += [a for a in c.state if isinstance(a, mx.array)]
    return out


def merge_states(caches: Sequence[Any], repeat: int = 1) -> Any:
    """One ``ArraysCache`` holding the rows of ``caches`` (any batch each) in order, each repeated ``repeat`` times.

    Args:
        caches: one layer's state caches, each filled (a prefill or a fed row ran through them).
        repeat: copies of each row (the group size n when one prefill is shared by the group).
    """
    from mlx_lm.models.cache import ArraysCache

    size = len(caches[0].cache)
    empty = [i for i, c in enumerate(caches) if any(a is None for a in c.cache)]
    if empty:
        raise ValueError(f"state cache {empty[0]} is empty: feed at least one token before merging")
    merged = ArraysCache(size)
    for e in range(size):
        parts = [c.cache[e] for c in caches]
        if repeat > 1:
            parts = [mx.repeat(a, repeat, axis=0) for a in parts]
        merged.cache[e] = mx.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
    return merged


def snapshot(cache: Sequence[Any]) -> Snapshot:
    """The arrays every state layer holds now: the model replaces them (``cache[i] = new``), so the old
    arrays stay valid after the next forward, at no copy."""
    return [list(c.cache) if is_state(c) else None for c in cache]


def state_row(arrays: Sequence[Any], i: int) -> Any:
    """Row ``i`` of one state layer's arrays as a single-row ``ArraysCache`` (copies queued for evaluation)."""
    from mlx_lm.models.cache import ArraysCache

    row = ArraysCache(len(arrays))
    row.cache = [mx.contiguous(a[i : i + 1]) for a in arrays]
    mx.async_eval(row.cache)
    return row
