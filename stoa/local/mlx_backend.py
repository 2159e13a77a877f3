"""MLX backend of the local mode: an mlx-lm model, nn.quantize'd base, mlx-lm LoRA layers, per-layer mx.checkpoint."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map, tree_unflatten

from stoa.algorithms import Algorithm, combine_metrics
from stoa.algorithms.batch import Batch, Packed, group_rows, pack
from stoa.algorithms.inputs import EchoStep, echo_step, micro_inputs
from stoa.algorithms.mlx_loss import token_hits, token_logprobs
from stoa.config.local import LocalConfig
from stoa.engines import Completion, GenStats, engine_from_model
from stoa.episodes.demo_rows import SftRow
from stoa.local import mlx_sft
from stoa.local.backend import (
    ADAPTER_LEAVES,
    ModelSummary,
    SftResult,
    check_same_arrays,
    choose_targets,
)
from stoa.local.mlx_parts import (
    DeferredDiagnostics,
    add_lora,
    enable_layer_checkpointing,
    quantize_blocks,
    tree_flatten,
)

_SPLIT_HEAD_MODULES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")
"""Model classes whose ``__call__`` is exactly ``head(self.model(x))``: the head can run on the gathered positions."""


class MLXBackend:
    """One mlx-lm model: quantized decoder linears (``nn.quantize``), LoRA via mlx-lm, adapters the only trainables.

    Args:
        cfg: validated local config.
        model_dir: HF model directory (safetensors).
    """

    name = "mlx"

    def __init__(self, cfg: LocalConfig, model_dir: Path):
        from mlx_lm.utils import load_model

        self.cfg = cfg
        dtype_name = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if mx.metal.is_available() else "float32")
        loaded: tuple[Any, dict[str, Any]] = load_model(Path(model_dir), lazy=True, strict=True)
        model, config = loaded
        model.set_dtype(getattr(mx, dtype_name))
        model.freeze()
        layers = list(model.layers)
        if cfg.quant_bits < 16:
            quantize_blocks(model, layers, cfg.quant_bits, cfg.quant_group_size)
        linears = [[n for n, m in layer.named_modules() if isinstance(m, nn.Linear | nn.QuantizedLinear)]
                   for layer in layers]
        self.targets = choose_targets(linears, cfg.lora_targets)
        mx.random.seed(cfg.seed)
        add_lora(layers, self.targets, cfg.lora_rank, cfg.lora_alpha / cfg.lora_rank)
        model.freeze()
        model.unfreeze(keys=list(ADAPTER_LEAVES), strict=False)
        if cfg.gradient_checkpointing:
            enable_layer_checkpointing(layers)
        mx.eval(model.parameters())
        self.model: Any = model
        self.layers = layers
        self.loras = [m for _, m in model.named_modules() if hasattr(m, "lora_a") and hasattr(m, "scale")]
        self.split_head = type(model).__module__ in _SPLIT_HEAD_MODULES
        self.temperature = cfg.temperature
        self.opt = optim.AdamW(learning_rate=cfg.lr, weight_decay=cfg.weight_decay, bias_correction=True)
        self.opt.init(model.trainable_parameters())
        self.sft_opt: optim.AdamW | None = None
        self.engine = engine_from_model(model, config, dtype_name)
        self._grads: Any = None
        self.summary = self._summary(str(model_dir), dtype_name)

    # ------------------------------------------------------------------------------------------- helpers
    @contextlib.contextmanager
    def adapters_disabled(self) -> Iterator[None]:
        """Scale every adapter by 0 inside the block (the reference policy)."""
        scales = [m.scale for m in self.loras]
        for m in self.loras:
            m.scale = 0.0
        try:
            yield
        finally:
            for m, s in zip(self.loras, scales, strict=True):
                m.scale = s

    def _logp(self, ids: mx.array, pos: mx.array, targets: mx.array, hits: bool = False
              ) -> tuple[mx.array, mx.array]:
        """[b, T] logprobs of ``targets`` (every position: actions and observations) and, with ``hits``, whether
        the argmax equals each target (zeros without); the LM head runs only on the gathered positions when it
        can."""
        if self.split_head:
            h = self.model.model(ids)
            b, length, width = h.shape
            flat = (mx.arange(b)[:, None] * length + pos).reshape(-1)
            h = h.reshape(b * length, width)[flat].reshape(b, -1, width)
            logits = self._head(h)
        else:
            logits = self.model(ids)
            b, length, vocab = logits.shape
            flat = (mx.arange(b)[:, None] * length + pos).reshape(-1)
            logits = logits.reshape(b * length, vocab)[flat].reshape(b, -1, vocab)
        logp = token_logprobs(logits, targets, self.temperature)
        return logp, token_hits(logits, targets) if hits else mx.zeros(logp.shape)

    def _score(self, batch: Batch, micro: Sequence[np.ndarray]) -> np.ndarray:
        out = np.zeros(batch.mask.shape, dtype=np.float32)
        for idx in micro:
            pk = pack(batch, idx)
            lp, _ = self._logp(mx.array(pk.input_ids), mx.array(pk.pos), mx.array(pk.targets))
            out[idx] = np.array(lp.astype(mx.float32)) * pk.mask
        return out

    def _head(self, h: mx.array) -> mx.array:
        return (self.model.model.embed_tokens.as_linear(h) if self.model.args.tie_word_embeddings
                else self.model.lm_head(h))

    def _group_logp(self, prompt: np.ndarray, tokens: np.ndarray) -> mx.array | None:
        """[n, T] logprobs of right-padded ``tokens`` after one shared ``prompt`` (run once, KV rows repeated).

        None when the model's head cannot be split off or its cache is not a plain ``KVCache`` (hybrid stacks).
        """
        from mlx_lm.models.cache import KVCache, make_prompt_cache

        cache = make_prompt_cache(self.model)
        if not self.split_head or not all(type(c) is KVCache for c in cache):
            return None
        n, width = tokens.shape
        h = self.model.model(mx.array(np.asarray(prompt, np.int32))[None], cache=cache)
        hidden = mx.repeat(h[:, -1:, :], n, axis=0)
        if width > 1:
            for c in cache:
                c.keys = mx.repeat(c.keys[..., : c.offset, :], n, axis=0)
                c.values = mx.repeat(c.values[..., : c.offset, :], n, axis=0)
            rest = self.model.model(mx.array(tokens[:, :-1]), cache=cache)
            hidden = mx.concatenate([hidden, rest], axis=1)
        return token_logprobs(self._head(hidden), mx.array(tokens), self.temperature)

    def _loss(self, pk: Packed, idx: np.ndarray, batch: Batch, plan: EchoStep, algo: Algorithm
              ) -> tuple[mx.array, mx.array, mx.array]:
        """(loss, logprobs, argmax hits) of one micro-batch (``pk`` packs the rows ``idx``); ``algo`` runs on
        deferred-diagnostics ops (no eval)."""
        logp, hits = self._logp(mx.array(pk.input_ids), mx.array(pk.pos), mx.array(pk.targets), plan.hits)
        loss, _ = algo.loss(_inputs(batch, idx, logp, plan, hits))
        return loss, logp, hits

    def _set_checkpointing(self, on: bool) -> None:
        if self.cfg.gradient_checkpointing:
            for layer in self.layers:
                layer._stoa_checkpoint = on

    # ------------------------------------------------------------------------------------------ protocol
    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        """Nothing to switch: the engine samples this model as it is (checkpointing is off outside updates)."""
        yield

    def generator(self, seed: int) -> int:
        """The seed itself (the MLX engine draws a key from it).

        Args:
            seed: the seed.
        """
        return seed

    def rollout(self, prompts: Sequence[Sequence[int]], n: int, *, max_new_tokens: int, temperature: float,
                top_p: float, eos_ids: Sequence[int], seed: int, greedy: bool = False
                ) -> tuple[list[list[Completion]], GenStats]:
        """Sample with the MLX engine on this model (one prefill per prompt, KV rows repeated, batched decode).

        Args:
            prompts: prompt token ids.
            n: completions per prompt.
            max_new_tokens: length cap.
            temperature: sampling temperature.
            top_p: nucleus mass.
            eos_ids: stop tokens.
            seed: sampling seed.
            greedy: argmax decoding (evaluation).
        """
        return self.engine.generate(prompts, n, max_new_tokens=max_new_tokens, temperature=temperature,
                                    top_p=top_p, eos_ids=eos_ids, generator=seed, greedy=greedy)

    def logprobs(self, batch: Batch, micro: Sequence[np.ndarray]) -> np.ndarray:
        """Old-policy logprobs [B, T] from a full forward per micro-batch (0 off the mask).

        Args:
            batch: the step's batch.
            micro: row indices per micro-batch (the training step's, so the numbers are identical).
        """
        return self._score(batch, micro)

    def ref_logprobs(self, batch: Batch, micro: Sequence[np.ndarray]) -> np.ndarray:
        """Reference logprobs [B, T] with every adapter scaled by 0, group by group with the prompt run once.

        The KL term needs no bitwise agreement with the update's forward, so the reference uses the
        shared-prefix forward (about 1e-6 from the full one in float32); models it does not cover use the
        full forward per micro-batch.

        Args:
            batch: the step's batch.
            micro: row indices per micro-batch (used by the full-forward fallback).
        """
        out = np.zeros(batch.mask.shape, dtype=np.float32)
        with self.adapters_disabled():
            for idx, prompt, tokens in group_rows(batch):
                lp = self._group_logp(prompt, tokens)
                if lp is None:
                    return self._score(batch, micro)
                out[idx] = np.array(lp) * batch.mask[idx]
        return out

    def accumulate(self, batch: Batch, micro: Sequence[np.ndarray], algo: Algorithm,
                   echo_alpha: float | None = None) -> dict[str, float]:
        """Forward/backward each micro-batch under the whole-batch normaliser; gradients add up.

        Multi-turn rows: ratio, clip, gate and KL see the action tokens only (``mask``); the ECHO term reads
        the logprobs of the echo tokens, and GiGPO's per-token advantages replace the per-row ones.

        Args:
            batch: the step's batch (``ref_logp`` set when kl_beta > 0). Without ``old_logp`` the old policy
                is this forward itself (stop-gradient; filled into ``batch.old_logp``).
            micro: row indices per micro-batch.
            algo: an MLX ``Algorithm``.
            echo_alpha: this step's ECHO coefficient (``Algorithm.echo_coefficient``); None: the config's.
        """
        value_and_grad = nn.value_and_grad(self.model, self._loss)
        concrete: Any = type(algo)  # every algorithm class is built from (cfg, ops)
        lazy: Algorithm = concrete(algo.cfg, DeferredDiagnostics())
        plan = echo_step(batch, algo, echo_alpha)
        reuse = batch.old_logp is None
        filled = np.zeros(batch.mask.shape, np.float32)
        parts, total = [], 0.0
        self._set_checkpointing(True)
        try:
            for idx in micro:
                pk = pack(batch, idx)
                (loss, logp, hits), grads = value_and_grad(pk, idx, batch, plan, lazy)
                self._grads = grads if self._grads is None else tree_map(mx.add, self._grads, grads)
                mx.eval(self._grads, loss, logp, hits)
                total += float(loss.item())
                parts.append(algo.loss(_inputs(batch, idx, logp, plan, hits))[1])
                filled[idx] = np.array(logp) * pk.mask
        finally:
            self._set_checkpointing(False)
        if reuse:
            batch.old_logp = filled
        out = combine_metrics(parts)
        out["loss"] = total
        return out

    def grad_arrays(self) -> dict[str, np.ndarray]:
        """Accumulated adapter gradients (zeros before any)."""
        if self._grads is None:
            return {k: np.zeros(v.shape, np.float32) for k, v in tree_flatten(self.model.trainable_parameters())}
        return {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(self._grads)}

    def apply_update(self) -> float:
        """Clip to ``grad_clip``, AdamW step, clear gradients; returns the pre-clip norm."""
        if self._grads is None:
            raise ValueError("no gradients: call accumulate first")
        grads = self._grads
        if self.cfg.grad_clip > 0:
            grads, norm = optim.clip_grad_norm(grads, self.cfg.grad_clip)
        else:
            norm = mx.sqrt(mx.array(sum(float(mx.sum(g.astype(mx.float32) ** 2)) for _, g in tree_flatten(grads))))
        self.opt.update(self.model, grads)
        mx.eval(self.model.trainable_parameters(), self.opt.state)
        self._grads = None
        return float(norm)

    def clear_grads(self) -> None:
        """Drop accumulated gradients without stepping."""
        self._grads = None

    def step(self, batch: Batch, micro: Sequence[np.ndarray], algo: Algorithm,
             echo_alpha: float | None = None) -> dict[str, float]:
        """``accumulate`` then ``apply_update``.

        Args:
            batch: the step's batch.
            micro: row indices per micro-batch.
            algo: an MLX ``Algorithm``.
            echo_alpha: this step's ECHO coefficient; None: the config's.
        """
        out = self.accumulate(batch, micro, algo, echo_alpha)
        out["grad_norm"] = self.apply_update()
        return out

    def sft_step(self, rows: Sequence[SftRow], micro: Sequence[np.ndarray], lr: float) -> SftResult:
        """One cold-start step with its own AdamW (``stoa.local.mlx_sft.sft_step``).

        Args:
            rows: the step's rows.
            micro: row indices per micro-batch.
            lr: the cold start's learning rate.
        """
        return mlx_sft.sft_step(self, rows, micro, lr)

    def adapter_arrays(self) -> dict[str, np.ndarray]:
        """Adapter weights by name, float32."""
        return {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(self.model.trainable_parameters())}

    def load_adapter_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Overwrite the adapters; names and shapes must match exactly.

        Args:
            arrays: name -> float32 array.
        """
        have = self.adapter_arrays()
        check_same_arrays(have, arrays, "adapter")
        self.model.load_weights([(k, mx.array(np.asarray(arrays[k], np.float32))) for k in have], strict=False)
        mx.eval(self.model.parameters())

    def optimizer_arrays(self) -> tuple[dict[str, np.ndarray], int]:
        """AdamW moments ``m/<name>``, ``v/<name>`` and the step count."""
        out: dict[str, np.ndarray] = {}
        step = 0
        for k, v in tree_flatten(self.opt.state):
            if k == "step":
                step = int(v.item())
            elif k.endswith((".m", ".v")):
                out[f"{k[-1]}/{k[:-2]}"] = np.array(v.astype(mx.float32))
        return out, step

    def load_optimizer_arrays(self, arrays: dict[str, np.ndarray], step: int) -> None:
        """Restore AdamW moments and step.

        Args:
            arrays: ``m/<name>`` and ``v/<name>`` arrays.
            step: the optimizer's step count.
        """
        check_same_arrays(self.optimizer_arrays()[0], arrays, "optimizer")
        flat = []
        for k, v in tree_flatten(self.opt.state):
            if k == "step":
                v = mx.array(step, dtype=mx.uint64)
            elif k.endswith((".m", ".v")):
                v = mx.array(np.asarray(arrays[f"{k[-1]}/{k[:-2]}"], np.float32))
            flat.append((k, v))
        self.opt.state = tree_unflatten(flat)
        self.opt.init(self.model.trainable_parameters())
        mx.eval(self.opt.state)

    def logits_shape(self, prompt: Sequence[int]) -> tuple[int, ...]:
        """Full-vocabulary logits shape of one forward.

        Args:
            prompt: token ids.
        """
        logits = self.model(mx.array([list(prompt)], dtype=mx.int32))
        mx.eval(logits)
        return tuple(logits.shape)

    def peak_memory_mb(self) -> float:
        """MLX allocator peak in MB since the process started (``mx.get_peak_memory``)."""
        return mx.get_peak_memory() / 1e6

    def _summary(self, model_id: str, dtype_name: str) -> ModelSummary:
        from mlx_lm.utils import get_total_parameters

        flat = tree_flatten(self.model.trainable_parameters())
        n_train = int(sum(v.size for _, v in flat))
        # get_total_parameters counts leaf modules only (a quantized weight as its logical size), so the
        # adapters (held by the non-leaf LoRA wrappers) are added here.
        return ModelSummary(
            model_id=model_id, backend=self.name, layers=len(self.layers), quant_bits=self.cfg.quant_bits,
            targets_per_layer=self.targets, total_params=int(get_total_parameters(self.model)) + n_train,
            trainable_params=n_train, trainable_names=[k for k, _ in flat],
            quantized_linears=sum(1 for _, m in self.model.named_modules() if _is_quantized(m)),
            extra={"dtype": dtype_name, "device": str(mx.default_device())})


def _inputs(batch: Batch, idx: np.ndarray, logp: mx.array, plan: EchoStep, hits: mx.array) -> Any:
    """The loss inputs of the rows ``idx`` in MLX arrays (``stoa.algorithms.inputs.micro_inputs``, the trainer's)."""
    return micro_inputs(batch, idx, logp, to=mx.array, stop=mx.stop_gradient, echo=plan.echo, echo_alpha=plan.alpha,
                        hits=hits if plan.hits else None, lags=False)


def _is_quantized(m: nn.Module) -> bool:
    """A quantized linear or a quantized bank of experts (``QuantizedSwitchLinear``)."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    return isinstance(m, nn.QuantizedLinear | QuantizedSwitchLinear)
