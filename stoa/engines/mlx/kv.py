"""The decode batch's KV cache: per-prompt caches merged into one left-padded batch, finished rows dropped."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from stoa.engines.mlx.sampling import Draw


def merge_rows(caches: Sequence[Any], repeat: int) -> Any:
    """One ``BatchKVCache`` from per-prompt ``KVCache``s (any batch each): left-padded, rows repeated.

    Args:
        caches: one prompt's cache for one layer each, in group order.
        repeat: copies of each row (the group size n when one prefill is shared by the group).
    """
    from mlx_lm.models.cache import BatchKVCache

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
    """Drop finished rows from the batch, its KV cache and the step already queued.

    Args:
        cache: the batch's per-layer ``BatchKVCache`` (filtered in place).
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
