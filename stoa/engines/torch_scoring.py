"""Scoring tokens with a torch causal LM: the one path the trainer's policy and local mode's torch backend use.

A packed micro-batch (``stoa.algorithms.batch.pack``, moved to the device by ``to_device``) runs through the
decoder once; the LM head runs only on the positions that predict a scored token, at most
``LOGITS_CHUNK_ELEMENTS`` logits at a time, and returns the temperature-scaled logprobs of the targets (and, if
asked, whether the argmax equals each target: ECHO's accuracy). ``group_score`` does the same for one group
whose rows share their prompt, running the prompt once and its KV cache for every row.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from stoa.algorithms.batch import Packed, pack_rows

__all__ = ["LOGITS_CHUNK_ELEMENTS", "LOGITS_KEEP_BYTES", "PackedTensors", "Scores", "TargetLogprobs", "group_score",
           "grouped_keys_on_cpu", "pack_tensors", "prefix_cache", "score", "to_device"]

LOGITS_CHUNK_ELEMENTS = 1 << 24
"""Most logits (positions x vocabulary) upcast to fp32 at once while scoring: 64 MB."""
LOGITS_KEEP_BYTES = 1 << 26
"""Most bytes of a micro-batch's logits (in their own dtype) kept for backward: 64 MiB. Up to this the head runs
once per chunk; beyond it each chunk is checkpointed (its logits recomputed in backward), so the full [B, T, V]
tensor is never kept."""


@dataclass
class PackedTensors:
    """A packed micro-batch on the model's device (``to_device``).

    ``pos[b, t]`` is the position whose output predicts token ``t`` after the prompt of row ``b``.
    """

    input_ids: torch.Tensor  # [B, L] int64
    attention_mask: torch.Tensor  # [B, L] int64
    pos: torch.Tensor  # [B, T] int64
    targets: torch.Tensor  # [B, T] int64
    mask: torch.Tensor  # [B, T] float, 1 on the positions to score (every token after the prompt, by default)


class Scores(NamedTuple):
    """What a forward returns for the tokens after the prompt."""

    logp: torch.Tensor
    """[B, T] float32 logprobs of the targets (with gradient), 0 off the mask."""
    hits: torch.Tensor | None
    """[B, T] float32 0/1: the argmax equals the target (no gradient), 0 off the mask; None unless asked."""


def to_device(pk: Packed, device: torch.device, scored: np.ndarray | None = None) -> PackedTensors:
    """The tensors of a packed micro-batch on ``device``.

    Args:
        pk: ``stoa.algorithms.batch.pack``'s arrays.
        device: the model's device.
        scored: [b, T] the positions to score; None: every token after the prompt.
    """
    after = pk.attention_mask.sum(axis=1) - pk.pos[:, 0] - 1  # tokens after each row's prompt
    every = (np.arange(pk.pos.shape[1])[None, :] < after[:, None]).astype(np.float32)

    def long(a: np.ndarray) -> torch.Tensor:
        return _tensor(a, device).long()

    return PackedTensors(long(pk.input_ids), long(pk.attention_mask), long(pk.pos), long(pk.targets),
                         _tensor(every if scored is None else scored, device))


def pack_tensors(prompts: Sequence[np.ndarray], completions: Sequence[np.ndarray], t_max: int,
                 device: torch.device) -> PackedTensors:
    """Right-pad prompt + completion rows onto ``device``, scoring every completion token.

    Args:
        prompts: prompt token ids per row.
        completions: completion token ids per row (non-empty).
        t_max: width of the completion axis (>= longest completion).
        device: where to put the tensors.
    """
    return to_device(pack_rows(prompts, completions, t_max), device)


def _tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


ROWS_PER_THREAD = 8
"""Rows of logits each CPU thread takes through the log-softmax's passes at a time: 8 rows of a 49k vocabulary in
fp32 (1.5 MB) stay in the CPU's caches between the upcast, the max, the exponentials and the sum."""


def _row_blocks(logits: torch.Tensor) -> list[slice]:
    """The row blocks of ``TargetLogprobs``' passes: on the CPU ``ROWS_PER_THREAD`` rows per thread, so each pass
    reads the block from cache rather than memory (4.7x faster on a [341, 49152] chunk); elsewhere every row at
    once, one kernel per pass. Bit-identical to one block: torch reduces each row of a block of two or more rows
    whole, on one thread (a lone row it splits across threads), so no block but a lone tensor's has one row."""
    rows = int(logits.shape[0])
    step = max(1, ROWS_PER_THREAD * torch.get_num_threads()) if logits.device.type == "cpu" else max(rows, 1)
    starts = list(range(0, rows, step)) or [0]
    if len(starts) > 1 and rows - starts[-1] == 1:
        starts.pop()  # the lone last row joins the block before it
    return [slice(a, b) for a, b in zip(starts, [*starts[1:], rows], strict=True)]


class TargetLogprobs(torch.autograd.Function):
    """``log_softmax(logits.float() / temperature)`` at ``targets`` for [N, V] ``logits``, fused: forward keeps only
    the logits (in their own dtype) and their fp32 logsumexp, backward forms ``g * (onehot - softmax) /
    temperature`` block by block and hands it back in the logits' dtype. Equal to the unfused autograd chain
    (tested), with a fraction of its elementwise passes, no fp32 [N, V] tensor kept for backward and, on the CPU,
    none formed at all (``_row_blocks``)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for rows in _row_blocks(logits):
            z = logits[rows].float()
            torch.logsumexp(z / temperature if temperature != 1.0 else z, dim=-1, out=lse[rows])
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1).float()
        return (picked / temperature if temperature != 1.0 else picked) - lse

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets, lse = ctx.saved_tensors
        g = grads[0].float() / ctx.temperature  # d logp / d logits = (onehot - softmax) / temperature
        out = torch.empty_like(logits)
        for rows in _row_blocks(logits):
            z = logits[rows].to(torch.float32, copy=True)
            if ctx.temperature != 1.0:
                z.div_(ctx.temperature)
            z.sub_(lse[rows].unsqueeze(-1)).exp_().mul_(-g[rows].unsqueeze(-1))
            out[rows] = z.scatter_add_(-1, targets[rows].unsqueeze(-1), g[rows].unsqueeze(-1))
        return out, None, None


def _chunk_scores(head: torch.nn.Module, h: torch.Tensor, targets: torch.Tensor, temperature: float, hits: bool
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs [N] of ``targets`` [N] under ``head(h)`` [N, V] / temperature, and with ``hits`` the argmax hits (no
    gradient)."""
    logits = head(h)
    lp = TargetLogprobs.apply(logits, targets, temperature)
    if not hits:
        return lp, None
    with torch.no_grad():
        return lp, (logits.argmax(dim=-1) == targets).float()


def _logits_bytes(head: torch.nn.Module, hidden: torch.Tensor) -> int:
    """Bytes per logit: the autocast dtype's where autocast is on, else the head weight's."""
    if torch.is_autocast_enabled(hidden.device.type):
        return torch.finfo(torch.get_autocast_dtype(hidden.device.type)).bits // 8
    return torch.finfo(head.weight.dtype).bits // 8  # type: ignore[arg-type]


def _scores(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
            temperature: float, hits: bool) -> Scores:
    """Temperature-scaled logprobs of ``targets`` [B, T] under ``head(hidden)`` ([B, T, H] -> [B, T, V]), times
    ``mask``; argmax hits if asked.

    Up to ``LOGITS_CHUNK_ELEMENTS`` logits at a time go through the head and the fused log-softmax and gather
    (``TargetLogprobs``). While the micro-batch's logits fit ``LOGITS_KEEP_BYTES`` they are kept for backward;
    past that each chunk runs under activation checkpointing, so backward keeps only the chunk's hidden states and
    recomputes its logits.
    """
    b, t, width = hidden.shape
    vocab = int(head.weight.shape[0])  # type: ignore[index]
    flat_h, flat_t = hidden.reshape(b * t, width), targets.reshape(b * t)
    step = max(1, LOGITS_CHUNK_ELEMENTS // vocab)
    keep = not torch.is_grad_enabled() or b * t * vocab * _logits_bytes(head, hidden) <= LOGITS_KEEP_BYTES
    if b * t <= step:
        lp, hit = _chunk_scores(head, flat_h, flat_t, temperature, hits)
    else:
        parts = [_chunk_scores(head, flat_h[i : i + step], flat_t[i : i + step], temperature, hits) if keep
                 else checkpoint(_chunk_scores, head, flat_h[i : i + step], flat_t[i : i + step], temperature, hits,
                                 use_reentrant=False) for i in range(0, b * t, step)]
        lp = torch.cat([p[0] for p in parts])
        hit = torch.cat([p[1] for p in parts]) if hits else None  # type: ignore[misc]
    out = lp.reshape(b, t) * mask
    return Scores(out, hit.reshape(b, t) * mask if hit is not None else None)


def _autocast(device: torch.device, dtype: torch.dtype | None) -> torch.autocast:
    """Autocast to ``dtype`` on ``device``; None: off."""
    return torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def score(lm: Any, batch: PackedTensors, *, temperature: float, autocast: torch.dtype | None = None,
          hits: bool = False) -> Scores:
    """Logprobs [B, T] of the masked positions of a packed micro-batch and, with ``hits``, whether the argmax
    equals the target.

    The LM head runs only on the positions after the prompt, which saves the vocabulary projection of every
    prompt token.

    Args:
        lm: an HF causal LM (``get_decoder``, ``get_output_embeddings``).
        batch: the micro-batch on the model's device.
        temperature: logits are divided by it before the log-softmax (the workers' sampling temperature).
        autocast: the compute dtype of an autocast around the forward (None: none).
        hits: also return the argmax hits (no gradient).
    """
    decoder = lm.get_decoder()
    head = lm.get_output_embeddings()
    with _autocast(batch.input_ids.device, autocast):
        hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        idx = batch.pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
        h = torch.gather(hidden, 1, idx)
        return _scores(head, h, batch.targets, batch.mask, temperature, hits)


def group_score(lm: Any, prompt: np.ndarray, completions: Sequence[np.ndarray], t_max: int,
                mask: np.ndarray | None = None, *, device: torch.device, temperature: float,
                autocast: torch.dtype | None = None, hits: bool = False) -> Scores:
    """Logprobs [n, t_max] of one group's rows (and argmax hits if asked), running the shared prompt only once.

    The prompt is forwarded once (with gradient when enabled) and its KV cache repeated for the ``n`` rows,
    which then attend to it; for short rows after a long prompt this cuts the forward/backward FLOPs several-fold.
    Equal to ``score(pack_tensors(...))`` (tested). Every real token is attended to, whatever ``mask`` says: it
    only selects the positions scored.

    Args:
        lm: an HF causal LM.
        prompt: the group's prompt token ids.
        completions: the ``n`` rows' tokens after the prompt (non-empty).
        t_max: width of the token axis.
        mask: [n, t_max] float, the positions to score; None: every real token.
        device: the model's device.
        temperature: logits are divided by it before the log-softmax.
        autocast: the compute dtype of an autocast around the forward (None: none).
        hits: also return the argmax hits (no gradient).
    """
    n, plen = len(completions), len(prompt)
    decoder = lm.get_decoder()
    head = lm.get_output_embeddings()
    comp = np.zeros((n, t_max), dtype=np.int64)
    real = np.zeros((n, t_max), dtype=np.float32)
    for i, c in enumerate(completions):
        comp[i, : len(c)] = c
        real[i, : len(c)] = 1.0
    scored = real if mask is None else np.asarray(mask, np.float32) * real
    comp_t, real_t = torch.from_numpy(comp).to(device), torch.from_numpy(real).to(device)
    kw = {"cache" if "cache" in _forward_params(decoder) else "past_key_values": prefix_cache(lm.config)}
    with _autocast(device, autocast):
        pre = decoder(input_ids=torch.from_numpy(np.asarray(prompt, np.int64))[None].to(device), use_cache=True, **kw)
        cache = next(iter(kw.values()))
        h_last = pre.last_hidden_state[:, -1:, :].expand(n, -1, -1)
        if t_max > 1:
            # reorder_cache: every layer kind has it (linear-attention layers lack batch_repeat_interleave)
            cache.reorder_cache(torch.zeros(n, dtype=torch.long, device=device))
            attn = torch.cat([torch.ones((n, plen), dtype=torch.long, device=device), real_t[:, :-1].long()], dim=1)
            pos = (plen + torch.arange(t_max - 1, device=device)).expand(n, -1)
            rest = decoder(input_ids=comp_t[:, :-1], attention_mask=attn, position_ids=pos, use_cache=True, **kw)
            hidden = torch.cat([h_last, rest.last_hidden_state], dim=1)
        else:
            hidden = h_last
        return _scores(head, hidden, comp_t, torch.from_numpy(scored).to(device), temperature, hits)


def grouped_keys_on_cpu() -> None:
    """Let transformers' SDPA attention keep grouped-query keys and values unrepeated on the CPU while gradients
    are on (once per process; idempotent).

    transformers repeats each KV head for its query heads (``repeat_kv``) whenever an attention mask is passed,
    except on XPU and MPS, because CUDA's fused kernels take no masked GQA. The CPU's kernels do
    (``enable_gqa``): the forward is bit-identical and the repeated keys and values are neither built nor kept
    for backward. On SmolLM2-135M (9 query heads on 3 KV heads) with the shared prefix that is 41 MB less kept
    per group, and the attention's backward runs on a third of the keys. The gradients of the keys and values
    then sum their query heads in fp32 inside the kernel instead of in bf16 after it. Without gradients
    (sampling, reference forwards) nothing changes. Trainer and local mode call it before they train.
    """
    try:
        from transformers.integrations import sdpa_attention
    except ImportError:  # a transformers without the integration: it repeats the keys as before
        return
    plain = sdpa_attention.use_gqa_in_sdpa
    if getattr(plain, "grouped_on_cpu", False):
        return

    def use_gqa(attention_mask: Any, key: torch.Tensor, *rest: Any) -> bool:
        if key.device.type == "cpu" and torch.is_grad_enabled():
            return True
        return plain(attention_mask, key, *rest)

    use_gqa.grouped_on_cpu = True  # type: ignore[attr-defined]
    use_gqa.plain = plain  # type: ignore[attr-defined]
    sdpa_attention.use_gqa_in_sdpa = use_gqa


def prefix_cache(config: Any) -> Any:
    """A ``DynamicCache`` for the shared-prefix forward that backward can run through, on every layer kind.

    The config gives hybrids' conv / linear-attention layers their cache kind. transformers updates a
    linear-attention layer's recurrent state in place (``copy_``, to keep a static address for cudagraphs), but the
    completions' forward saves that state for backward (qwen3.5's gated delta rule multiplies by it), so backward
    would fail on a modified tensor: here those layers keep each new state by assignment instead.

    Args:
        config: the model's config.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    try:
        from transformers.cache_utils import LinearAttentionLayer
    except ImportError:  # transformers without hybrid caches: nothing to replace
        return cache

    class AssigningLayer(LinearAttentionLayer):
        """Keeps each recurrent state by assignment (autograd-safe) instead of ``copy_``."""

        def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0,
                                   **kwargs: Any) -> torch.Tensor:
            self.recurrent_states[state_idx] = recurrent_states
            self.is_recurrent_states_initialized[state_idx] = True
            return recurrent_states

    for i, layer in enumerate(cache.layers):
        if type(layer) is LinearAttentionLayer:
            cache.layers[i] = AssigningLayer(number_of_states=layer.number_of_states)
    return cache


def _forward_params(module: torch.nn.Module) -> set[str]:
    return set(inspect.signature(module.forward).parameters)
