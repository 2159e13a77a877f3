"""Per-row KV caches of paused multi-turn rows (torch): slice a row out of the batch, feed it, merge rows back.

A row that pauses for a tool call leaves the decoding batch with its KV (every layer, without its left
padding) and its last sampled token, which was never fed. At the round boundary each resumed row is fed
``[last token] + observation`` at batch 1 on its own cache, with positions continuing the row's length,
and the rows are merged into one left-padded ``DecodeBatch`` (mask zeros on the padding, explicit positions),
so every row's positions stay contiguous: prompt, then every token, as the trainer's full forward sees them.
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
        self.cache.batch_select_indices(sel)
        self.active = [self.active[i] for i in keep]
        self.mask, self.next_pos = self.mask[sel], self.next_pos[sel]
        return sel


@dataclass
class RowKV:
    """One paused row's cache, outside any batch."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer (keys, values), each [1, heads, length, head_dim], without padding."""
    length: int
    """Tokens in the cache (the position of the token fed next)."""
    last: int
    """The row's last sampled token (not fed yet)."""
    logits: torch.Tensor | None = None
    """[V] float32 logits after the last feed (None until fed)."""


def _layer_kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of every layer of a ``DynamicCache`` (transformers >= 4.56 keeps them in ``layers``)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return [(cache.key_cache[i], cache.value_cache[i]) for i in range(len(cache.key_cache))]
    return [(layer.keys, layer.values) for layer in layers]


def make_cache(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A ``DynamicCache`` holding the given per-layer keys and values.

    Args:
        layers: per layer (keys, values), each [batch, heads, length, head_dim].
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
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
    kv = _layer_kv(batch.cache)
    width = int(batch.mask.shape[1])
    out: dict[int, RowKV] = {}
    for i, tok in zip(positions, tokens, strict=True):
        length = int(batch.next_pos[i, 0])
        layers = [(k[i:i + 1, :, width - length:].clone(), v[i:i + 1, :, width - length:].clone()) for k, v in kv]
        out[batch.active[i]] = RowKV(layers, length, int(tok))
    return out


def feed_row(model: Any, cache_kw: str, row: RowKV, ids: Sequence[int]) -> None:
    """Feed tokens to one row at batch 1 on its own cache (positions continue the row's length).

    Args:
        model: the HF causal LM.
        cache_kw: the name of its cache argument (``past_key_values`` or ``cache``).
        row: the row's cache; its layers, length and logits are updated.
        ids: the tokens to feed (the last sampled token, then the observation).
    """
    cache = make_cache(row.layers)
    dev = row.layers[0][0].device
    width = row.length + len(ids)
    inp = torch.tensor([list(ids)], dtype=torch.long, device=dev)
    pos = torch.arange(row.length, width, dtype=torch.long, device=dev)[None]
    mask = torch.ones((1, width), dtype=torch.long, device=dev)
    out = model(input_ids=inp, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                **{cache_kw: cache})
    row.layers, row.length, row.logits = _layer_kv(cache), width, out.logits[0, -1, :].float()


def merge_rows(rows: Mapping[int, RowKV]) -> DecodeBatch:
    """One left-padded decoding batch from fed rows (row order), positions continuing each row's length.

    Args:
        rows: row number -> its fed cache (``logits`` set).

    Raises:
        ValueError: no rows, or a row was never fed.
    """
    if not rows:
        raise ValueError("merge_rows: no rows to merge")
    order = sorted(rows)
    width = max(rows[r].length for r in order)
    first = rows[order[0]].layers[0][0]
    mask = torch.zeros((len(order), width), dtype=torch.long, device=first.device)
    layers: list[tuple[torch.Tensor, torch.Tensor]] = []
    for li in range(len(rows[order[0]].layers)):
        ks, vs = [], []
        for r in order:
            k, v = rows[r].layers[li]
            pad = width - rows[r].length
            ks.append(torch.nn.functional.pad(k, (0, 0, pad, 0)) if pad else k)
            vs.append(torch.nn.functional.pad(v, (0, 0, pad, 0)) if pad else v)
        layers.append((torch.cat(ks, dim=0), torch.cat(vs, dim=0)))
    logits = []
    for b, r in enumerate(order):
        mask[b, width - rows[r].length:] = 1
        lg = rows[r].logits
        if lg is None:
            raise ValueError(f"merge_rows: row {r} was never fed; feed_row it first")
        logits.append(lg)
    next_pos = torch.tensor([[rows[r].length] for r in order], dtype=torch.long, device=first.device)
    return DecodeBatch(active=order, cache=make_cache(layers), mask=mask, next_pos=next_pos,
                       logits=torch.stack(logits))


def resume_rows(model: Any, cache_kw: str, paused: Mapping[int, RowKV],
                fed: Mapping[int, Sequence[int]]) -> DecodeBatch | None:
    """Feed each resumed row ``[last token] + observation`` on its own cache and merge them into one batch.

    Args:
        model: the HF causal LM.
        cache_kw: the name of its cache argument.
        paused: row -> the cache it paused with (rows not in ``fed`` have ended: their caches are dropped).
        fed: row -> its observation tokens (``EpisodeDriver.resume``).

    Returns:
        the resumed rows as one decoding batch; None when none resumed.
    """
    rows = {r: paused[r] for r in fed}
    for r, obs in fed.items():
        feed_row(model, cache_kw, rows[r], [rows[r].last, *obs])
    return merge_rows(rows) if rows else None
