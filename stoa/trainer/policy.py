"""The trainer's policy: fp32 master weights, logprobs of the tokens after the prompt, weight export.

With a LoRA spec (``lora_rank`` > 0) the base is frozen (stored in the compute dtype on one rank, fp32 when
sharded: FSDP2 gathers one dtype per unit) and only the float32 adapters (``stoa.models.lora_torch``) train;
``export_f32`` is the merged weights (``W + scale * B @ A``); the trainer publishes the base once and then
``adapter_f32`` alone (the adapter plane, ``stoa.weights.adapter``).

Multi-turn rows hold the policy's turns and the environment's observations: the forward scores the positions
its ``mask`` marks (the trainer passes actions and echo tokens) and can also report, without gradient, whether
the argmax equals each target (ECHO's accuracy).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from stoa.engines.torch import model_tensors
from stoa.engines.torch_scoring import PackedTensors, Scores, group_score, grouped_keys_on_cpu, score
from stoa.models.lora_torch import (
    LoraSpec,
    add_lora,
    decoder_blocks,
    is_adapter,
    lora_disabled,
    matches,
    merge_arrays,
)
from stoa.models.quant_torch import QuantLinear, quant_linears, quantize_linears
from stoa.trainer.compute_copy import COMPUTE_WEIGHTS, ComputeCopy
from stoa.trainer.dist import SINGLE, Dist, full_arrays, load_full, shard
from stoa.trainer.lean import lean_activations
from stoa.weights.planes import GROUP_SIZE, QUANT_BITS


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


def _round_buffers_to_bf16(model: torch.nn.Module, names: Sequence[str]) -> None:
    """Round the published buffers (never trained) to bf16 values once: both planes carry them as bf16 bits, so
    the trainer then computes with exactly what the workers load (lfm2-moe's expert bias picks the experts)."""
    with torch.no_grad():
        for name in names:
            b = model.get_buffer(name)
            b.copy_(b.to(torch.bfloat16).to(b.dtype))


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
        lora: train a LoRA adapter on the frozen base (None: full fine-tuning); its base is stored like the
            reference's (in ``compute_dtype`` on one rank, fp32 when sharded), its adapters in fp32.
        seed: seed of the adapters' initialisation.
        compute_weights: how a bf16 policy computes (``stoa.trainer.compute_copy``): ``autocast`` casts the fp32
            masters per forward; ``bf16_copy`` runs forward and backward on a persistent bf16 copy refreshed
            after each optimizer step (gradients land on the masters in fp32). Only an unsharded full fine-tune
            keeps a copy: a LoRA base and a frozen policy are stored in bf16 already, and FSDP2 gathers bf16.
        lean: recompute the norms' and SwiGLU's elementwise intermediates in backward instead of keeping them
            (``stoa.trainer.lean``; bit-exact); an unsharded trainable policy without gradient checkpointing only.
        base_plane: a LoRA policy's quantized base (``lora_base_plane``): ``int8g64`` or ``int4g64`` holds every
            decoder-block linear as that plane's codes and bf16 scales (``stoa.models.quant_torch.QuantLinear``
            with ``bf16``), dequantized per call to the plane's values; empty keeps the base at ``stored`` dtype.
    """

    def __init__(self, model_dir: str | Path, device: torch.device, *, temperature: float = 1.0,
                 gradient_checkpointing: bool = False, trainable: bool = True, dist: Dist = SINGLE,
                 compute_dtype: torch.dtype = torch.float32, lora: LoraSpec | None = None, seed: int = 0,
                 compute_weights: str = "autocast", lean: bool = True, base_plane: str = ""):
        from transformers import AutoModelForCausalLM

        grouped_keys_on_cpu()
        self.device, self.temperature, self.dist = device, temperature, dist
        self.lora = lora if trainable else None
        frozen_base = not trainable or self.lora is not None
        stored = compute_dtype if frozen_base and not dist.sharded else torch.float32
        self.base_plane = base_plane if self.lora is not None else ""
        if self.base_plane and dist.sharded:
            raise ValueError("lora_base_plane needs a one-rank trainer; leave it empty to shard the base")
        # A quantized base loads in bf16 (the plane rounds every tensor to bf16 first, so nothing it keeps is lost,
        # and the float model held while quantizing is half fp32's), then its float rest takes the stored dtype.
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if self.base_plane
                                                          else stored)
        if self.base_plane:
            quantize_linears(decoder_blocks(model), bits=QUANT_BITS[self.base_plane], group_size=GROUP_SIZE,
                             packed=True, bf16=True)
            for p in model.parameters():
                p.data = p.data.to(stored)
        self.lora_paths = add_lora(model, self.lora, seed, _targets(model, self.lora)) if self.lora is not None else []
        self.model: Any = model.to(device)
        self.model.config.use_cache = False
        self.gradient_checkpointing = gradient_checkpointing
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train(trainable)
        for name, p in self.model.named_parameters():
            p.requires_grad_(trainable and (self.lora is None or is_adapter(name)))
        quant = {f"{p}.{b}" for p in quant_linears(self.model) for b in ("scales", "biases")}
        self.buffer_names = sorted(set(model_tensors(self.model)) - set(dict(self.model.named_parameters())) - quant)
        _round_buffers_to_bf16(self.model, self.buffer_names)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.root = _Root(self.model)
        self.compute_dtype = compute_dtype
        if dist.sharded:
            shard(self.root, decoder_blocks(self.model), dist, compute_dtype)
        if compute_weights not in COMPUTE_WEIGHTS:
            raise ValueError(f"compute_weights {compute_weights!r}: use one of {', '.join(COMPUTE_WEIGHTS)}")
        unsharded_bf16 = compute_dtype == torch.bfloat16 and not dist.sharded
        self.copy = (ComputeCopy(self.model, compute_dtype) if unsharded_bf16 and trainable and self.lora is None
                     and compute_weights == "bf16_copy" else None)
        # Unsharded bf16 without a copy: autocast (sharded: the gathered parameters already compute in bf16).
        self.autocast = unsharded_bf16 and self.copy is None
        self.copy_root = _Root(self.copy.module) if self.copy is not None else None
        self.lean = lean and trainable and not gradient_checkpointing and not dist.sharded
        if self.lean:  # on the module that computes (a copy deep-copied from a lean master would call the master)
            lean_activations(self.copy.module if self.copy is not None else self.model)

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The model's parameters by name (tied weights appear once; a LoRA policy's adapters included)."""
        return dict(self.model.named_parameters())

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps: every parameter, or a LoRA policy's adapters only."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """What the published weights hold: the parameters, then the checkpoint's buffers (``buffer_names``)."""
        return {**self.named_parameters(), **{k: self.model.get_buffer(k) for k in self.buffer_names}}

    def logprobs(self, batch: PackedTensors) -> torch.Tensor:
        """Log-probabilities [B, T] of each token after the prompt under the temperature-scaled policy, 0 off
        ``batch.mask`` (``score(batch).logp``).

        Args:
            batch: a packed micro-batch.
        """
        return self.score(batch).logp

    def score(self, batch: PackedTensors, *, hits: bool = False) -> Scores:
        """Logprobs [B, T] of the masked positions and, with ``hits``, whether the argmax equals the target
        (``stoa.engines.torch_scoring.score`` through the root, which gathers a sharded model's parameters).

        Args:
            batch: a packed micro-batch.
            hits: also return the argmax hits (no gradient).
        """
        return self._root()(functools.partial(score, batch=batch, temperature=self.temperature,
                                              autocast=self._autocast_dtype(), hits=hits))

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
        """Logprobs [n, t_max] of one group's rows (and argmax hits if asked), running the prompt only once
        (``stoa.engines.torch_scoring.group_score``; equal to ``score`` of the packed rows, tested).

        Args:
            prompt: the group's prompt token ids.
            completions: the ``n`` rows' tokens after the prompt (non-empty).
            t_max: width of the token axis.
            mask: [n, t_max] float, the positions to score; None: every real token.
            hits: also return the argmax hits (no gradient).
        """
        return self._root()(functools.partial(group_score, prompt=prompt, completions=completions, t_max=t_max,
                                              mask=mask, device=self.device, temperature=self.temperature,
                                              autocast=self._autocast_dtype(), hits=hits))

    def _root(self) -> torch.nn.Module:
        """What a score runs through: the root (the masters), or the bf16 copy (refreshed if stale)."""
        if self.copy is None or self.copy_root is None:
            return self.root
        self.copy.sync()
        return self.copy_root

    def refresh_copy(self) -> None:
        """Round the masters into the bf16 compute copy (after an optimizer step); nothing without a copy."""
        if self.copy is not None:
            self.copy.refresh()

    def sampling_model(self) -> Any:
        """The model the trainer samples from inside ``sampling()``: the bf16 copy when it has one (the function
        the steps train), else the master model."""
        return self.model if self.copy is None else self.copy.sync()

    def _autocast_dtype(self) -> torch.dtype | None:
        """bf16 when the forward autocasts (``autocast``), else None."""
        return torch.bfloat16 if self.autocast else None

    def sampling(self) -> contextlib.AbstractContextManager[Any]:
        """Where the trainer samples from its own model (held-out evals, rft): the forward the steps train, so the
        figures are the policy's. Without it a bf16-autocast policy would be evaluated in fp32, a different
        function: after 4 GRPO steps at lr 2e-5 on SmolLM2 its fp32 master answered 0.021 cover-EM where its own
        bf16 forward (and the published weights every worker samples) answered 0.708. Sample from
        ``sampling_model()``: a bf16 copy when the policy keeps one."""
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def export_f32(self) -> dict[str, np.ndarray]:
        """The master weights as float32 numpy arrays (names as ``named_tensors``), on rank 0 (``{}`` on other
        ranks, which must call it too: a sharded model's parameters are gathered). A LoRA policy's are the merged
        weights (``W + scale * B @ A``) under the base's names, without adapter tensors.

        On CPU the arrays share memory with the live parameters: consume them (e.g. with
        ``state_from_f32``) before the next optimizer step, or copy them.
        """
        arrays = full_arrays(self.named_tensors(), self.dist)
        if self.lora is None or not self.dist.main:
            return arrays
        arrays.update({f"{p}.weight": q.dequantized().cpu().numpy() for p, q in quant_linears(self.model).items()})
        return merge_arrays(arrays, self.lora_paths, self.lora.scale)

    def base_plane_bits(self) -> dict[str, np.ndarray]:
        """A quantized base's linears as the weights plane stores them (``<p>.weight`` uint32 codes, ``<p>.scales``
        and ``<p>.biases`` bf16 bits); ``{}`` for a base at the compute dtype."""
        out: dict[str, np.ndarray] = {}
        for path, q in quant_linears(self.model).items():
            out[f"{path}.weight"], out[f"{path}.scales"], out[f"{path}.biases"] = q.plane_bits()
        return out

    def load_base_plane_bits(self, state: dict[str, np.ndarray]) -> None:
        """Set a quantized base's linears from a published base's stored bits (``base_plane_bits``' inverse).

        Args:
            state: the published base in the policy's ``base_plane`` (``stoa.weights.planes.State``).
        """
        for path, q in quant_linears(self.model).items():
            q.load_plane_bits(state[f"{path}.weight"], state[f"{path}.scales"], state[f"{path}.biases"])

    def adapter_f32(self) -> dict[str, np.ndarray]:
        """A LoRA policy's adapter tensors as float32 arrays by parameter name on rank 0 (``{}`` elsewhere, and
        for full fine-tuning); every rank calls it."""
        named: dict[str, torch.Tensor] = {k: p for k, p in self.named_parameters().items() if is_adapter(k)}
        return {k: v.copy() for k, v in full_arrays(named, self.dist).items()}

    def load_f32(self, named: dict[str, np.ndarray] | None) -> None:
        """Overwrite the parameters from float32 arrays (e.g. when resuming); every rank calls it, rank 0 with
        the arrays (other ranks: None).

        Args:
            named: parameter name -> full array (rank 0).

        Raises:
            ValueError: the names are not the model's parameters, or the policy is a LoRA policy (its published
                weights are merged: base and adapter cannot be told apart; it resumes from its checkpoint).
        """
        if self.lora is not None:
            raise ValueError("a LoRA policy cannot load merged full weights; it resumes from its checkpoint")
        load_full(self.named_tensors(), named, self.dist)


def _targets(model: torch.nn.Module, spec: LoraSpec) -> list[str] | None:
    """The paths ``add_lora`` adapts on a quantized base (its own rule sees ``nn.Linear`` only): every linear or
    ``QuantLinear`` a target names; None on a float base."""
    quant = quant_linears(model)
    if not quant:
        return None
    return [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, QuantLinear))
            and matches(n, spec.targets)]


class Reference(Protocol):
    """What ``train_step`` asks of the KL's reference policy: a frozen ``Policy``, or a LoRA policy's ``BaseView``."""

    def logprobs(self, batch: PackedTensors) -> torch.Tensor:
        """Logprobs [B, T] of a packed micro-batch (``Policy.logprobs``)."""
        ...

    def group_logprobs(self, prompt: np.ndarray, completions: Sequence[np.ndarray], t_max: int,
                       mask: np.ndarray | None = None) -> torch.Tensor:
        """Logprobs [n, t_max] of one group over its prompt's KV cache (``Policy.group_logprobs``)."""
        ...


class BaseView:
    """A LoRA policy with every adapter bypassed (``stoa.models.lora_torch.lora_disabled``): its frozen base, the KL's
    reference, on the policy's own model instead of a second copy of the base (local mode's reference the same way).

    Args:
        policy: a LoRA policy.
    """

    def __init__(self, policy: Policy):
        if policy.lora is None:
            raise ValueError("BaseView needs a LoRA policy; a full fine-tune's reference is a frozen Policy")
        self.policy = policy

    def logprobs(self, batch: PackedTensors) -> torch.Tensor:
        """The base's logprobs [B, T] of a packed micro-batch.

        Args:
            batch: a packed micro-batch.
        """
        with lora_disabled(self.policy.model):
            return self.policy.logprobs(batch)

    def group_logprobs(self, prompt: np.ndarray, completions: Sequence[np.ndarray], t_max: int,
                       mask: np.ndarray | None = None) -> torch.Tensor:
        """The base's logprobs [n, t_max] of one group, its prompt run once.

        Args:
            prompt: the group's prompt token ids.
            completions: the rows' tokens after the prompt.
            t_max: width of the token axis.
            mask: [n, t_max] the positions to score; None: every real token.
        """
        with lora_disabled(self.policy.model):
            return self.policy.group_logprobs(prompt, completions, t_max, mask)
