"""Torch decoding batches drop the left padding no row attends to once rows leave (``torch_rows.trim_padding``):
the mask and every layer's keys narrow, and the rows' logits, tokens and logprobs stay what they were; joined caches
are the rows left-padded with zeros, copied once."""

from __future__ import annotations

import torch

import stoa.engines.torch_rows as torch_rows
from stoa.tokenize import TextCodec

from .test_torch_episodes import QUESTIONS, TOL, run


def _widths(batch) -> set[int]:
    return {int(layer.keys.shape[-2]) for layer in batch.cache.layers}


@torch.inference_mode()
def test_a_long_prompts_rows_leaving_narrow_the_batch_to_the_rows_left_with_the_same_logits(torch_engine,
                                                                                            monkeypatch):
    short, long = list(range(5, 12)), list(range(20, 45))
    batches = [torch_engine._prefill([long, short], 2) for _ in range(2)]
    tok = torch.tensor([3, 4])
    monkeypatch.setattr(torch_rows, "trim_padding", lambda batch: 0)
    batches[0].compact([2, 3])  # the short prompt's two rows go on, untrimmed
    monkeypatch.undo()
    batches[1].compact([2, 3])
    assert batches[0].mask.shape[1] == len(long) and batches[1].mask.shape[1] == len(short)
    assert _widths(batches[1]) == {len(short)} and bool(batches[1].mask.all())
    for b in batches:
        torch_engine._forward(b, tok)
        torch_engine._forward(b, tok)
    assert torch.allclose(batches[0].logits, batches[1].logits, atol=TOL, rtol=0)
    assert _widths(batches[1]) == {len(short) + 2}


@torch.inference_mode()
def test_a_column_that_any_row_attends_to_is_kept(torch_engine):
    short, long = list(range(5, 12)), list(range(20, 45))
    batch = torch_engine._prefill([long, short], 1)
    batch.compact([1, 0])  # both rows go on: the long row uses every column
    assert batch.mask.shape[1] == len(long) and _widths(batch) == {len(long)}
    assert torch_rows.trim_padding(batch) == 0
    assert batch.mask.sum(dim=1).tolist() == [len(short), len(long)]


def test_episodes_with_trimmed_padding_are_the_same_tokens_and_logprobs(torch_engine, tiny_dir, monkeypatch):
    codec = TextCodec(tiny_dir)
    trimmed: list[int] = []
    real = torch_rows.trim_padding

    def counting(batch):
        trimmed.append(real(batch))
        return trimmed[-1]

    monkeypatch.setattr(torch_rows, "trim_padding", counting)
    fast, _, _ = run(torch_engine, codec, QUESTIONS, 2, seed=5)
    monkeypatch.setattr(torch_rows, "trim_padding", lambda batch: 0)
    slow, _, _ = run(torch_engine, codec, QUESTIONS, 2, seed=5)
    assert sum(trimmed) > 0
    for ga, gb in zip(fast, slow, strict=True):
        for a, b in zip(ga, gb, strict=True):
            assert (a.tokens, a.roles, a.end_reason) == (b.tokens, b.roles, b.end_reason)
            assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)), default=0.0) <= TOL


def test_joined_and_merged_caches_are_the_rows_left_padded_with_zeros_copied_once(tiny_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_dir)
    layers = config.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    parts = [[torch.rand((b, 2, w, 4), generator=g) for _ in range(2 * layers)] for b, w in ((2, 5), (1, 3))]
    caches = [torch_rows.make_cache(config, [torch_rows.LayerRow(p[2 * i], p[2 * i + 1]) for i in range(layers)])
              for p in parts]
    assert caches[0].layers[0].keys.data_ptr() == parts[0][0].data_ptr()  # held as given: no copy
    masks = [torch.ones((2, 5), dtype=torch.long), torch.ones((1, 3), dtype=torch.long)]
    batches = [torch_rows.DecodeBatch(list(range(len(m))), c, m, m.sum(1, keepdim=True), torch.zeros(len(m), 3))
               for c, m in zip(caches, masks, strict=True)]
    joined = torch_rows.join_batches(batches[0], batches[1], config)
    assert joined.mask.tolist() == [[1] * 5, [1] * 5, [0, 0, 1, 1, 1]]
    for i in range(layers):
        for k in (0, 1):
            got = (joined.cache.layers[i].keys, joined.cache.layers[i].values)[k]
            want = torch.cat([parts[0][2 * i + k], torch.nn.functional.pad(parts[1][2 * i + k], (0, 0, 2, 0))])
            assert torch.equal(got, want)
    assert joined.cache.layers[0].keys.data_ptr() not in {parts[0][0].data_ptr(), parts[1][0].data_ptr()}
