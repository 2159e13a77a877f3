"""The trainer's policy: fp32 master weights, logprobs of the tokens after the prompt, weight export.

Multi-turn rows hold the policy's turns and the environment's observations: the forward scores the positions
its ``mask`` marks (the trainer passes actions and echo tokens) and can also report, without gradient, whether
the argmax equals each target (ECHO's accuracy).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from stoa.engines.torch import model_tensors
from stoa.trainer.dist import SINGLE, Dist, full_arrays, load_full, shard


@dataclass
class Packed:
    """A micro-batch of (prompt + completion) sequences, right-padded, with gather indices.

    ``pos[b, t]`` is the position whose output predicts completion token ``t`` of row ``b``.
    """

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    pos: torch.Tensor  # [B, T]
    targets: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] float, 1 on the positions to score (every real token, by default)


class Scores(NamedTuple):
    """What a forward returns for the tokens after the prompt."""

    logp: torch.Tensor
    """[B, T] float32 logprobs of the targets (with gradient), 0 off the mask."""
    hits: torch.Tensor | None
    """[B, T] float32 0/1: the argmax equals the target (no gradient), 0 off the mask; None unless asked."""


LOGITS_CHUNK_ELEMENTS = 1 << 24
"""Most logits (positions x vocabulary) alive at once while scoring: 64 MB in fp32. Longer micro-batches are scored
in chunks whose logits are recomputed in backward, so the full [B, T, V] tensor is never materialised."""


def _chunk_scores(head: torch.nn.Module, h: torch.Tensor, targets: torch.Tensor, temperature: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs [N] of ``targets`` [N] under ``head(h)`` [N, V] / temperature, and the argmax hits (no gradient)."""
    logits = head(h).float() / temperature
    lp = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    with torch.no_grad():
        hit = (logits.argmax(dim=-1) == targets).float()
    return lp, hit


def _scores(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
            temperature: float, hits: bool, chunk_elements: int | None = None) -> Scores:
    """Temperature-scaled logprobs of ``targets`` [B, T] under ``head(hidden)`` ([B, T, H] -> [B, T, V]), times
    ``mask``; argmax hits if asked.

    Up to ``chunk_elements`` logits at a time: each chunk of positions goes through the head, log-softmax and gather
    under activation checkpointing, so backward keeps only the chunk's hidden states and recomputes its logits.
    """
    b, t, width = hidden.shape
    vocab = int(head.weight.shape[0])  # type: ignore[index]
    flat_h, flat_t = hidden.reshape(b * t, width), targets.reshape(b * t)
    step = max(1, (chunk_elements or LOGITS_CHUNK_ELEMENTS) // vocab)
    if b * t <= step:
        lp, hit = _chunk_scores(head, flat_h, flat_t, temperature)
    else:
        from torch.utils.checkpoint import checkpoint

        parts = [checkpoint(_chunk_scores, head, flat_h[i : i + step], flat_t[i : i + step], temperature,
                            use_reentrant=False) for i in range(0, b * t, step)]
        lp, hit = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    out = lp.reshape(b, t) * mask
    return Scores(out, hit.reshape(b, t) * mask if hits else None)


def pack(prompts: Sequence[np.ndarray], completions: Sequence[np.ndarray], t_max: int, device: torch.device) -> Packed:
    """Right-pad prompt+completion sequences and build the completion gather indices.

    Args:
        prompts: prompt token ids per row.
        completions: completion token ids per row (non-empty).
        t_max: width of the completion axis (>= longest completion).
        device: where to put the tensors.
    """
    b = len(prompts)
    seq_lens = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    width = max(seq_lens)
    ids = np.zeros((b, width), dtype=np.int64)
    am = np.zeros((b, width), dtype=np.int64)
    pos = np.zeros((b, t_max), dtype=np.int64)
    tgt = np.zeros((b, t_max), dtype=np.int64)
    msk = np.zeros((b, t_max), dtype=np.float32)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        lp, lc = len(p), len(c)
        ids[i, :lp] = p
        ids[i, lp : lp + lc] = c
        am[i, : lp + lc] = 1
        pos[i, :lc] = np.arange(lp - 1, lp + lc - 1)
        tgt[i, :lc] = c
        msk[i, :lc] = 1.0
    t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    return Packed(t(ids), t(am), t(pos), t(tgt), t(msk))


class _Root(torch.nn.Module):
    """The module every score runs through: under FSDP2 its forward gathers the parameters outside the decoder
    blocks (embeddings, final norm, a tied head) around the whole computation, which calls the decoder and the
    head separately (the head runs only on the scored positions)."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, fn: Callable[[Any], Any]) -> Any:
        return fn(self.lm)


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """The trainer's compute dtype for the ``dtype`` setting: ``auto`` is bf16 on CUDA and on a CPU that
    multiplies bf16 in hardware (2-3x the fp32 matmul rate), fp32 elsewhere.

    Args:
        name: ``auto``, ``float32`` or ``bfloat16``.
        device: the trainer's device.
    """
    if name == "auto":
        from stoa.engines.torch import cpu_has_native_bf16

        native = device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())
        return torch.bfloat16 if native else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder blocks of an HF causal LM (FSDP2's and activation checkpointing's unit).

    Args:
        model: the model.
    """
    layers = getattr(model.get_decoder(), "layers", None)  # type: ignore[operator]
    if layers is not None:
        return list(layers)
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


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


def _round_buffers_to_bf16(model: torch.nn.Module, names: Sequence[str]) -> None:
    """Round the published buffers (never trained) to bf16 values once: both planes carry them as bf16 bits, so
    the trainer then computes with exactly what the workers load (lfm2-moe's expert bias picks the experts)."""
    with torch.no_grad():
        for name in names:
            b = model.get_buffer(name)
            b.copy_(b.to(torch.bfloat16).to(b.dtype))


def _forward_params(module: torch.nn.Module) -> set[str]:
    import inspect

    return set(inspect.signature(module.forward).parameters)


class Policy:
    """An HF causal LM in fp32 (master weights) that scores completions.

    Args:
        model_dir: HF directory (config + safetensors).
        device: torch device.
        temperature: logits are divided by it before log-softmax (must match the workers').
        gradient_checkpointing: recompute each decoder block's activations during backward.
        trainable: whether parameters get gradients (False for the frozen reference).
        dist: the trainer's ranks; with more than one the model is sharded (FSDP2) over them.
        compute_dtype: what the forward and backward compute in (default: fp32): bf16 autocasts the matmuls
            (sharded: the gathered parameters are bf16); master weights, optimizer state and the log-softmax stay
            fp32. An unsharded frozen policy (the reference) is stored in this dtype: it has no master weights to
            keep, so bf16 halves its memory and skips the per-forward casts.
    """

    def __init__(self, model_dir: str | Path, device: torch.device, *, temperature: float = 1.0,
                 gradient_checkpointing: bool = False, trainable: bool = True, dist: Dist = SINGLE,
                 compute_dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        self.device, self.temperature, self.dist = device, temperature, dist
        stored = compute_dtype if not trainable and not dist.sharded else torch.float32
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=stored)
        self.model: Any = model.to(device)
        self.model.config.use_cache = False
        self.gradient_checkpointing = gradient_checkpointing
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train(trainable)
        for p in self.model.parameters():
            p.requires_grad_(trainable)
        self.buffer_names = sorted(set(model_tensors(self.model)) - set(dict(self.model.named_parameters())))
        _round_buffers_to_bf16(self.model, self.buffer_names)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.root = _Root(self.model)
        self.compute_dtype = compute_dtype
        if dist.sharded:
            shard(self.root, decoder_blocks(self.model), dist, compute_dtype)
        # Unsharded bf16: autocast (sharded: the gathered parameters already compute in bf16).
        self.autocast = compute_dtype == torch.bfloat16 and not dist.sharded

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Trainable parameters by name (tied weights appear once)."""
        return dict(self.model.named_parameters())

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """What the published weights hold: the parameters, then the checkpoint's buffers (``buffer_names``)."""
        return {**self.named_parameters(), **{k: self.model.get_buffer(k) for k in self.buffer_names}}

    def logprobs(self, batch: Packed) -> torch.Tensor:
        """Log-probabilities [B, T] of each token after the prompt under the temperature-scaled policy, 0 off
        ``batch.mask`` (``score(batch).logp``).

        Args:
            batch: a packed micro-batch.
        """
        return self.score(batch).logp

    def score(self, batch: Packed, *, hits: bool = False) -> Scores:
        """Logprobs [B, T] of the masked positions and, with ``hits``, whether the argmax equals the target.

        The LM head runs only on the positions after the prompt, which saves the vocabulary
        projection of every prompt token.

        Args:
            batch: a packed micro-batch.
            hits: also return the argmax hits (no gradient).
        """
        return self.root(functools.partial(self._score, batch=batch, hits=hits))

    def _score(self, lm: Any, *, batch: Packed, hits: bool) -> Scores:
        decoder = lm.get_decoder()
        head = lm.get_output_embeddings()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
            idx = batch.pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
            h = torch.gather(hidden, 1, idx)
            return _scores(head, h, batch.targets, batch.mask, self.temperature, hits)

    def group_logprobs(self, prompt: np.ndarray, completions: Sequence[np.ndarray], t_max: int,
                       mask: np.ndarray | None = None) -> torch.Tensor:
        """Logprobs [n, t_max] of one group's rows, running the shared prompt only once
        (``group_score(...).logp``).

        Args:
            prompt: the group's prompt token ids.
            completions: the ``n`` rows' tokens after the prompt (non-empty).
            t_max: width of the token axis.
            mask: [n, t_max] float, the positions to score; None: every real token.
        """
        return self.group_score(prompt, completions, t_max, mask).logp

    def group_score(self, prompt: np.ndarray, completions: Sequence[np.ndarray], t_max: int,
                    mask: np.ndarray | None = None, *, hits: bool = False) -> Scores:
        """Logprobs [n, t_max] of one group's rows (and argmax hits if asked), running the prompt only once.

        The prompt is forwarded once (with gradient) and its KV cache repeated for the ``n`` rows, which
        then attend to it; for short rows after a long prompt this cuts the forward/backward FLOPs
        several-fold. Equal to ``score(pack(...))`` (tested). Every real token is attended to, whatever
        ``mask`` says: it only selects the positions scored.

        Args:
            prompt: the group's prompt token ids.
            completions: the ``n`` rows' tokens after the prompt (non-empty).
            t_max: width of the token axis.
            mask: [n, t_max] float, the positions to score; None: every real token.
            hits: also return the argmax hits (no gradient).
        """
        return self.root(functools.partial(self._group_score, prompt=prompt, completions=completions, t_max=t_max,
                                           mask=mask, hits=hits))

    def _group_score(self, lm: Any, *, prompt: np.ndarray, completions: Sequence[np.ndarray], t_max: int,
                     mask: np.ndarray | None, hits: bool) -> Scores:
        dev, n, plen = self.device, len(completions), len(prompt)
        decoder = lm.get_decoder()
        head = lm.get_output_embeddings()
        comp = np.zeros((n, t_max), dtype=np.int64)
        real = np.zeros((n, t_max), dtype=np.float32)
        for i, c in enumerate(completions):
            comp[i, : len(c)] = c
            real[i, : len(c)] = 1.0
        scored = real if mask is None else np.asarray(mask, np.float32) * real
        comp_t, real_t = torch.from_numpy(comp).to(dev), torch.from_numpy(real).to(dev)
        kw = {"cache" if "cache" in _forward_params(decoder) else "past_key_values": prefix_cache(lm.config)}
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.autocast):
            pre = decoder(input_ids=torch.from_numpy(np.asarray(prompt, np.int64))[None].to(dev), use_cache=True, **kw)
            cache = next(iter(kw.values()))
            h_last = pre.last_hidden_state[:, -1:, :].expand(n, -1, -1)
            if t_max > 1:
                # reorder_cache: every layer kind has it (linear-attention layers lack batch_repeat_interleave)
                cache.reorder_cache(torch.zeros(n, dtype=torch.long, device=dev))
                attn = torch.cat([torch.ones((n, plen), dtype=torch.long, device=dev), real_t[:, :-1].long()], dim=1)
                pos = (plen + torch.arange(t_max - 1, device=dev)).expand(n, -1)
                rest = decoder(input_ids=comp_t[:, :-1], attention_mask=attn, position_ids=pos, use_cache=True, **kw)
                hidden = torch.cat([h_last, rest.last_hidden_state], dim=1)
            else:
                hidden = h_last
            return _scores(head, hidden, comp_t, torch.from_numpy(scored).to(dev), self.temperature, hits)

    def export_f32(self) -> dict[str, np.ndarray]:
        """The master weights as float32 numpy arrays (names as ``named_parameters``), on rank 0 (``{}`` on other
        ranks, which must call it too: a sharded model's parameters are gathered).

        On CPU the arrays share memory with the live parameters: consume them (e.g. with
        ``state_from_f32``) before the next optimizer step, or copy them.
        """
        return full_arrays(self.named_tensors(), self.dist)

    def load_f32(self, named: dict[str, np.ndarray] | None) -> None:
        """Overwrite the parameters from float32 arrays (e.g. when resuming); every rank calls it, rank 0 with
        the arrays (other ranks: None).

        Args:
            named: parameter name -> full array (rank 0).

        Raises:
            ValueError: the names are not the model's parameters.
        """
        load_full(self.named_tensors(), named, self.dist)
