"""Per-row KV caches of paused multi-turn rows (torch): slice a row out of the batch, feed it, merge rows back.

A row that pauses for a tool call leaves the decoding batch with its KV (every layer, without its left
padding) and its last sampled token, which was never fed. At the round boundary each resumed row is fed
``[last token] + observation`` at batch 1 on its own cache, with positions continuing the row's length,
and the rows are merged into one left-padded ``DecodeBatch`` (mask zeros on the padding, explicit positions),
so every row's positions stay contiguous: prompt, then every token, as the trainer's full forward sees them.

Hybrids (lfm2's short convolutions, qwen3.5's gated-delta linear attention) also hold per-layer conv / recurrent
states with no length axis: a row takes its own slice of them and rows are stacked back as they are, so left
padding never reaches them (``LayerRow``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class DecodeBatch:
    """The rows still decoding, in batch order, and what the next forward needs."""

    active: list[int]
    """Row numbers (``g * n + j``) of the rows in the batch."""
    cache: Any
    """The transformers ``DynamicCache`` of those rows."""
    mask: torch.Tensor
    """[rows, width] attention mask (left padding is 0)."""
    next_pos: torch.Tensor
    """[rows, 1] position of the token fed next."""
    logits: torch.Tensor
    """[rows, V] float32 logits of the last position."""

    def compact(self, keep: list[int]) -> torch.Tensor:
        """Drop finished rows from the batch and the cache.

        Args:
            keep: batch positions of the rows that go on.

        Returns:
            ``keep`` as an index tensor on the batch's device (to select the same rows elsewhere).
        """
        sel = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.cache.reorder_cache(sel)  # conv / linear-attention layers have no batch_select_indices
        self.active = [self.active[i] for i in keep]
        self.mask, self.next_pos = self.mask[sel], self.next_pos[sel]
        trim_padding(self)
        return sel


def trim_padding(batch: DecodeBatch) -> int:
    """Drop the leading columns that no row attends to (every row's mask 0) from the mask and every attention
    layer's keys and values, as mlx-lm's ``BatchKVCache.filter`` does: once the longest row leaves, the others
    stop attending over (and the cache stops copying) its padding. Positions are explicit: no row's positions change.

    Args:
        batch: the decoding batch (its mask and cache are trimmed in place).

    Returns:
        the columns dropped; 0 when none is padding everywhere or a layer is not a plain ``DynamicLayer``
        (sliding windows count their tokens) with one key per column.
    """
    lead = int(batch.mask.any(dim=0).to(torch.int8).argmax())
    layers = getattr(batch.cache, "layers", None)
    if lead == 0 or layers is None:  # transformers < 4.56: left as it is
        return 0
    from transformers.cache_utils import DynamicLayer

    attn = [layer for layer in layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]
    widths = {int(layer.keys.shape[-2]) for layer in attn}
    if widths != {int(batch.mask.shape[1])} or any(type(layer) is not DynamicLayer for layer in attn):
        return 0
    for layer in attn:
        layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]
    batch.mask = batch.mask[:, lead:]
    return lead


@dataclass(frozen=True)
class LayerRow:
    """One layer's state of one row, outside any batch: attention keys/values without the left padding, and/or
    the fixed-size states of a conv / linear-attention layer (hybrids: lfm2, qwen3.5), which have no length axis."""

    keys: torch.Tensor | None
    """[1, heads, length, head_dim] (attention layers), else None."""
    values: torch.Tensor | None
    """Same shape as ``keys``."""
    conv: tuple[torch.Tensor | None, ...] = ()
    """Per state index, the [1, channels, kernel] conv state (conv / linear-attention layers)."""
    recurrent: tuple[torch.Tensor | None, ...] = ()
    """Per state index, the recurrent state (gated-delta layers; None for lfm2's short convolutions)."""


@dataclass
class RowKV:
    """One paused row's cache, outside any batch."""

    layers: list[LayerRow]
    """Per layer, the row's state."""
    length: int
    """Tokens in the cache (the position of the token fed next)."""
    last: int
    """The row's last sampled token (not fed yet)."""
    logits: torch.Tensor | None = None
    """[V] float32 logits after the last feed (None until fed)."""


def _linear_mixin() -> type | None:
    """transformers' conv / linear-attention cache layer base (None before transformers 5 had hybrid caches)."""
    try:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin
    except ImportError:
        return None
    return LinearAttentionCacheLayerMixin


def _states(states: Mapping[int, Any], ready: Mapping[int, bool], rows: slice,
            copy: bool) -> tuple[torch.Tensor | None, ...]:
    return tuple((states[s][rows].clone() if copy else states[s][rows]) if ready[s] else None for s in sorted(states))


def _layer_rows(cache: Any, rows: slice, real: slice | torch.Tensor, copy: bool = True) -> list[LayerRow]:
    """Every layer's state of ``rows`` of a cache; keys and values keep the positions ``real`` (the row's tokens:
    a slice past the left padding, or the indices where its mask is 1 when padding lies inside the row).
    ``copy`` False: views where indexing allows (for a caller that copies them anyway and drops the cache)."""
    def take(t: torch.Tensor) -> torch.Tensor:
        return t[rows, :, real].clone() if copy else t[rows, :, real]

    layers = getattr(cache, "layers", None)
    if layers is None:  # transformers < 4.56: key_cache / value_cache lists, attention only
        return [LayerRow(take(k), take(v)) for k, v in zip(cache.key_cache, cache.value_cache, strict=True)]
    linear = _linear_mixin()
    out = []
    for layer in layers:
        keys = values = None
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            keys, values = take(layer.keys), take(layer.values)
        conv: tuple[torch.Tensor | None, ...] = ()
        rec: tuple[torch.Tensor | None, ...] = ()
        if linear is not None and isinstance(layer, linear):
            conv = _states(layer.conv_states, layer.is_conv_states_initialized, rows, copy)
            rec = _states(layer.recurrent_states, layer.is_recurrent_states_initialized, rows, copy)
        out.append(LayerRow(keys, values, conv, rec))
    return out


def make_cache(config: Any, layers: Sequence[LayerRow]) -> Any:
    """A ``DynamicCache`` (of the model's layer kinds) holding the given per-layer states, ready to decode on.

    Args:
        config: the model's config (None: attention layers only).
        layers: per layer, its state ([batch, ...] tensors).
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache: Any = DynamicCache(config=config) if config is not None else DynamicCache()
    for i, layer in enumerate(layers):
        if layer.keys is not None and layer.values is not None:
            cache.update(layer.keys[..., :0, :], layer.values[..., :0, :], i)  # makes layer i, of its kind
            held = getattr(cache, "layers", None)
            if held is not None and type(held[i]) is DynamicLayer:  # hold the tensors as they are: no copy
                held[i].keys, held[i].values = layer.keys, layer.values
            else:
                cache.update(layer.keys, layer.values, i)
        for s, conv in enumerate(layer.conv):
            if conv is not None:  # a first update stores the state as it is and marks the layer as having one
                cache.layers[i].update_conv_state(conv, s, conv_kernel_size=conv.shape[-1])
        for s, rec in enumerate(layer.recurrent):
            if rec is not None:
                cache.layers[i].update_recurrent_state(rec, s)
    return cache


def take_rows(batch: DecodeBatch, positions: Sequence[int], tokens: Sequence[int]) -> dict[int, RowKV]:
    """Slice rows out of a decoding batch's cache, without their left padding.

    Args:
        batch: the decoding batch (unchanged).
        positions: batch positions of the rows to take.
        tokens: each one's last sampled token.

    Returns:
        row number -> its cache.
    """
    out: dict[int, RowKV] = {}
    for i, tok in zip(positions, tokens, strict=True):
        length = int(batch.next_pos[i, 0])
        real = batch.mask[i].nonzero().squeeze(-1)  # feed_batch leaves pad positions inside a row
        if int(real.numel()) != length:
            raise ValueError(f"take_rows: row {batch.active[i]} has {int(real.numel())} cached tokens, not {length}")
        out[batch.active[i]] = RowKV(_layer_rows(batch.cache, slice(i, i + 1), real), length, int(tok))
    return out


def feed_row(model: Any, cache_kw: str, row: RowKV, ids: Sequence[int]) -> None:
    """Feed tokens to one row at batch 1 on its own cache (positions continue the row's length).

    Args:
        model: the HF causal LM.
        cache_kw: the name of its cache argument (``past_key_values`` or ``cache``).
        row: the row's cache; its layers, length and logits are updated.
        ids: the tokens to feed (the last sampled token, then the observation).
    """
    config = getattr(model, "config", None)
    cache = make_cache(config, row.layers)
    dev = _device(row.layers)
    width = row.length + len(ids)
    inp = torch.tensor([list(ids)], dtype=torch.long, device=dev)
    pos = torch.arange(row.length, width, dtype=torch.long, device=dev)[None]
    mask = torch.ones((1, width), dtype=torch.long, device=dev)
    out = model(input_ids=inp, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                **{cache_kw: cache})
    row.layers, row.length = _layer_rows(cache, slice(0, 1), slice(0, width)), width
    row.logits = out.logits[0, -1, :].float()


def _device(layers: Sequence[LayerRow]) -> torch.device:
    for layer in layers:
        for t in (layer.keys, *layer.conv, *layer.recurrent):
            if t is not None:
                return t.device
    raise ValueError("a row with no cached state: prefill it first")


def _stack_left(parts: Sequence[torch.Tensor | None], pads: Sequence[int]) -> torch.Tensor | None:
    """[b, heads, length, dim] tensors as one batch, each left-padded with zeros by its pad: one copy."""
    if any(p is None for p in parts):
        return None
    ts = [p for p in parts if p is not None]
    width = max(int(t.shape[-2]) + pad for t, pad in zip(ts, pads, strict=True))
    out = ts[0].new_zeros((sum(int(t.shape[0]) for t in ts), ts[0].shape[1], width, ts[0].shape[-1]))
    start = 0
    for t, pad in zip(ts, pads, strict=True):
        out[start:start + t.shape[0], :, pad:pad + t.shape[-2]] = t
        start += int(t.shape[0])
    return out


def _cat(parts: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    return None if any(p is None for p in parts) else torch.cat(list(parts), dim=0)  # type: ignore[arg-type]


def _merge_layer(parts: Sequence[LayerRow], pads: Sequence[int]) -> LayerRow:
    """One layer of several rows as one batch: keys/values left-padded to one length, states stacked."""
    keys = _stack_left([p.keys for p in parts], pads)
    values = _stack_left([p.values for p in parts], pads)
    conv = tuple(_cat([p.conv[s] for p in parts]) for s in range(len(parts[0].conv)))
    rec = tuple(_cat([p.recurrent[s] for p in parts]) for s in range(len(parts[0].recurrent)))
    return LayerRow(keys, values, conv, rec)


def _merged(rows: Mapping[int, RowKV], order: Sequence[int], config: Any) -> tuple[Any, torch.Tensor]:
    """The rows' caches as one left-padded cache (keys/values padded, states stacked), and its [rows, width] mask."""
    width = max(rows[r].length for r in order)
    dev = _device(rows[order[0]].layers)
    pads = [width - rows[r].length for r in order]
    layers = [_merge_layer([rows[r].layers[li] for r in order], pads) for li in range(len(rows[order[0]].layers))]
    mask = torch.zeros((len(order), width), dtype=torch.long, device=dev)
    for b, pad in enumerate(pads):
        mask[b, pad:] = 1
    return make_cache(config, layers), mask


def merge_rows(rows: Mapping[int, RowKV], config: Any = None) -> DecodeBatch:
    """One left-padded decoding batch from fed rows (row order), positions continuing each row's length.

    Attention keys and values are left-padded (mask zeros); conv / recurrent states have no length axis and are
    stacked as they are, so the padding never reaches them.

    Args:
        rows: row number -> its fed cache (``logits`` set).
        config: the model's config, for the cache's layer kinds (None: attention layers only).

    Raises:
        ValueError: no rows, or a row was never fed.
    """
    if not rows:
        raise ValueError("merge_rows: no rows to merge")
    order = sorted(rows)
    unfed = [r for r in order if rows[r].logits is None]
    if unfed:
        raise ValueError(f"merge_rows: row {unfed[0]} was never fed; feed_row it first")
    cache, mask = _merged(rows, order, config)
    next_pos = torch.tensor([[rows[r].length] for r in order], dtype=torch.long, device=mask.device)
    return DecodeBatch(active=order, cache=cache, mask=mask, next_pos=next_pos,
                       logits=torch.stack([rows[r].logits for r in order]))  # type: ignore[misc]


def has_states(rows: Mapping[int, RowKV]) -> bool:
    """True when the rows hold conv / recurrent states (hybrids): padding inside a fed sequence would reach them."""
    return any(layer.conv or layer.recurrent for row in rows.values() for layer in row.layers)


def feed_batch(model: Any, cache_kw: str, rows: Mapping[int, RowKV], fed: Mapping[int, Sequence[int]]) -> DecodeBatch:
    """Feed every row its tokens in ONE forward and return the rows as one decoding batch (row order).

    The rows' caches merge left-padded to one width; the fed tokens are left-padded to one length after them,
    so each row's last position is the batch's last and its pad positions (before and inside the sequence) are
    mask zeros that no real query sees. Positions continue each row's length, so every real token is computed
    as ``feed_row`` computes it (the same logprobs up to float rounding). Attention-only models: a hybrid's
    conv / recurrent states would read the pad tokens (``has_states``; feed those one at a time).

    Args:
        model: the HF causal LM.
        cache_kw: the name of its cache argument.
        rows: row -> its cache (every row of ``fed``).
        fed: row -> the tokens to feed it (its last sampled token, then the observation); none empty.
    """
    order = sorted(fed)
    cache, cmask = _merged(rows, order, getattr(model, "config", None))
    dev, width = cmask.device, max(len(fed[r]) for r in order)
    ids = torch.zeros((len(order), width), dtype=torch.long, device=dev)
    imask = torch.zeros_like(ids)
    pos = torch.zeros_like(ids)
    for b, r in enumerate(order):
        k, start = len(fed[r]), rows[r].length
        ids[b, width - k:] = torch.tensor(list(fed[r]), dtype=torch.long, device=dev)
        imask[b, width - k:] = 1
        pos[b] = torch.arange(start + k - width, start + k, device=dev).clamp(min=start)
    mask = torch.cat([cmask, imask], dim=1)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                **{cache_kw: cache})
    next_pos = torch.tensor([[rows[r].length + len(fed[r])] for r in order], dtype=torch.long, device=dev)
    return DecodeBatch(active=order, cache=cache, mask=mask, next_pos=next_pos, logits=out.logits[:, -1, :].float())


def join_batches(a: DecodeBatch, b: DecodeBatch, config: Any = None) -> DecodeBatch:
    """Two decoding batches as one (``a``'s rows, then ``b``'s): the narrower cache and mask are left-padded.

    Args:
        a: rows decoding (their logits set by the last forward).
        b: rows just resumed.
        config: the model's config, for the cache's layer kinds.
    """
    wa, wb = int(a.mask.shape[1]), int(b.mask.shape[1])
    width = max(wa, wb)
    parts = [_layer_rows(x.cache, slice(None), slice(None), copy=False) for x in (a, b)]  # _merge_layer copies
    pads = [width - wa, width - wb]
    layers = [_merge_layer([parts[0][li], parts[1][li]], pads) for li in range(len(parts[0]))]
    mask = torch.cat([torch.nn.functional.pad(a.mask, (pads[0], 0)), torch.nn.functional.pad(b.mask, (pads[1], 0))])
    return DecodeBatch(active=a.active + b.active, cache=make_cache(config, layers), mask=mask,
                       next_pos=torch.cat([a.next_pos, b.next_pos]), logits=torch.cat([a.logits, b.logits]))


def resume_rows(model: Any, cache_kw: str, paused: Mapping[int, RowKV],
                fed: Mapping[int, Sequence[int]], batched: bool = True) -> DecodeBatch | None:
    """Feed each resumed row ``[last token] + observation`` and return the resumed rows as one batch.

    Args:
        model: the HF causal LM.
        cache_kw: the name of its cache argument.
        paused: row -> the cache it paused with (rows not in ``fed`` have ended: their caches are dropped).
        fed: row -> its observation tokens (``EpisodeDriver.resume``).
        batched: feed every row in one forward (``feed_batch``) unless the model is a hybrid; False feeds each
            row at batch 1 on its own cache (``feed_row``), then merges.

    Returns:
        the resumed rows as one decoding batch; None when none resumed.
    """
    if not fed:
        return None
    rows = {r: paused[r] for r in fed}
    if batched and not has_states(rows):
        return feed_batch(model, cache_kw, rows, {r: [rows[r].last, *obs] for r, obs in fed.items()})
    for r, obs in fed.items():
        feed_row(model, cache_kw, rows[r], [rows[r].last, *obs])
    return merge_rows(rows, getattr(model, "config", None))
