"""The decode batch's cache: per-prompt caches merged into one left-padded batch, finished rows dropped,
single rows taken out of the batch (a paused episode) and fed more tokens at batch 1.

Attention layers hold KV (handled here); conv / linear-attention layers hold a fixed-size state
(``stoa.engines.mlx.caches``, which says why a state needs no padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from stoa.engines.mlx.caches import Snapshot, cache_arrays, is_state, merge_states, state_row
from stoa.engines.mlx.sampling import Draw


def merge_rows(caches: Sequence[Any], repeat: int = 1) -> Any:
    """One batch cache for one layer from per-row caches (any batch each), rows repeated ``repeat`` times.

    ``KVCache``s (any length each) become a left-padded ``BatchKVCache``; state caches (``ArraysCache``)
    stack their rows (``caches.merge_states``). Merges per-prompt prefill caches, and the single-row caches
    of resumed episodes (``take_row``).

    Args:
        caches: one cache for one layer each, in batch order.
        repeat: copies of each row (the group size n when one prefill is shared by the group).
    """
    from mlx_lm.models.cache import BatchKVCache

    if is_state(caches[0]):
        return merge_states(caches, repeat)

    width = max(c.offset for c in caches)
    keys, values, pad = [], [], []
    for c in caches:
        left = width - c.offset
        k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
        if left:
            widths = [(0, 0), (0, 0), (left, 0), (0, 0)]
            k, v = mx.pad(k, widths), mx.pad(v, widths)
        if repeat > 1:
            k, v = mx.repeat(k, repeat, axis=0), mx.repeat(v, repeat, axis=0)
        keys.append(k)
        values.append(v)
        pad += [left] * k.shape[0]
    merged = BatchKVCache(pad)
    merged.keys = mx.concatenate(keys, axis=0)
    merged.values = mx.concatenate(values, axis=0)
    merged.offset = merged.offset + width
    merged._idx = width
    return merged


def compact(cache: Sequence[Any], active: list[int], keep: list[int], nxt: Draw) -> tuple[list[int], Draw]:
    """Drop finished rows from the batch, its cache (KV and state layers) and the step already queued.

    Args:
        cache: the batch's per-layer ``BatchKVCache`` / ``ArraysCache`` (filtered in place).
        active: row numbers still decoding, in batch order.
        keep: batch positions of the rows that go on.
        nxt: the next step's draw (queued before this step was read).

    Returns:
        the remaining row numbers and their part of ``nxt``.
    """
    idx = mx.array(keep, dtype=mx.int32)
    for c in cache:
        c.filter(idx)
    return [active[i] for i in keep], Draw(nxt.tokens[idx], nxt.logprobs[idx], nxt.key)


def take_row(cache: Sequence[Any], i: int, drop_last: int = 0, before: Snapshot | None = None) -> list[Any]:
    """Row ``i`` of the batch's per-layer cache as single-row caches, without its left padding.

    The copies are queued for evaluation at once, so the batch's buffers are not kept alive by them.

    Args:
        cache: the batch's per-layer ``BatchKVCache`` / ``ArraysCache``.
        i: the row's batch position.
        drop_last: positions to leave out at the end (1: the token a queued decode step already fed).
        before: state layers' arrays before that step (``caches.snapshot``); needed when ``drop_last`` is 1
            and the model has state layers (a state cannot drop a token).

    Returns:
        per layer, a ``KVCache`` with keys/values ``[1, H, L, D]`` and ``offset`` = L, the row's true length,
        or a single-row ``ArraysCache``.
    """
    from mlx_lm.models.cache import KVCache

    kv = [c for c in cache if not is_state(c)]
    pad = int(kv[0].left_padding[i].item()) if kv else 0
    rows: list[Any] = []
    for layer, c in enumerate(cache):
        if is_state(c):
            rows.append(state_row(_state_before(c, layer, drop_last, before), i))
            continue
        end = c._idx - drop_last
        if end < pad:
            raise ValueError(f"drop_last={drop_last}: row {i} holds only {c._idx - pad} positions")
        row = KVCache()
        row.keys = mx.contiguous(c.keys[i : i + 1, :, pad:end, :])
        row.values = mx.contiguous(c.values[i : i + 1, :, pad:end, :])
        row.offset = end - pad
        rows.append(row)
    mx.async_eval(cache_arrays(rows))
    return rows


def _state_before(c: Any, layer: int, drop_last: int, before: Snapshot | None) -> list[Any]:
    """A state layer's arrays ``drop_last`` tokens ago: now (0) or the snapshot's (1)."""
    if drop_last == 0:
        return c.cache
    held = before[layer] if before is not None and drop_last == 1 else None
    if held is None:
        raise ValueError(f"drop_last={drop_last}: a state layer (conv / linear attention) can only give back "
                         "the last token, from a snapshot made before that step (caches.snapshot)")
    return held


def feed(model: Any, cache: Sequence[Any], ids: Sequence[int] | mx.array, chunk: int) -> mx.array:
    """Run ``ids`` through ``model`` after ``cache`` (extended in place); return the last position's logits.

    Prompts fill a fresh cache at batch 1 or n; a resumed episode row feeds its last token and observation
    at batch 1 into its own cache (``take_row``). Every position but the last only fills the cache: the
    vocabulary projection of those is never evaluated.

    Args:
        model: the mlx-lm model.
        cache: per-layer KV caches of the rows.
        ids: ``[rows, L]`` token ids, or a list of ids for one row (at least one token).
        chunk: tokens per forward (bounds the attention scores' memory on long inputs).

    Returns:
        ``[rows, V]`` logits after the last token.
    """
    x = ids if isinstance(ids, mx.array) else mx.array([int(t) for t in ids], dtype=mx.int32)[None]
    if x.shape[1] == 0:
        raise ValueError("ids: feed needs at least one token")
    for start in range(0, x.shape[1] - 1, chunk):
        model(x[:, start : min(start + chunk, x.shape[1] - 1)], cache=cache)
        mx.eval(cache_arrays(cache))
    return model(x[:, -1:], cache=cache)[:, -1, :]
