"""Torch backend of the local mode: an HF model with a quantized frozen base and LoRA adapters (CPU or CUDA)."""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stoa.algorithms import Algorithm, combine_metrics
from stoa.algorithms.batch import Batch, Packed, group_indices, pack
from stoa.algorithms.inputs import action_tokens, echo_step, pack_sft
from stoa.algorithms.torch_accumulate import MicroForward, accumulate
from stoa.algorithms.torch_loss import clip_and_step
from stoa.config.local import LocalConfig
from stoa.engines import Completion, GenStats
from stoa.engines.torch import TorchEngine, resolve_device
from stoa.engines.torch_scoring import Scores, group_score, grouped_keys_on_cpu, score, to_device
from stoa.episodes.demo_rows import SftRow
from stoa.local.backend import (
    ModelSummary,
    SftResult,
    check_same_arrays,
)
from stoa.local.torch_lora import quantize_base
from stoa.models.lora_torch import (
    LoraSpec,
    add_lora,
    from_mlx_lm,
    lora_disabled,
    mlx_lm_name,
    peft_targets,
    to_mlx_lm,
)
from stoa.models.quant_torch import QuantLinear


class TorchBackend:
    """One HF causal LM: float32 storage, quantized decoder linears, LoRA adapters the only trainable leaves.

    The adapters are the fleet trainer's (``stoa.models.lora_torch``: PEFT's layout, ``lora_A`` [r, in] and
    ``lora_B`` [out, r]); what the backend reports and saves is mlx-lm's (``adapter_arrays``: ``lora_a`` [in, r],
    ``lora_b`` [r, out]), the MLX backend's names and layout.

    Args:
        cfg: validated local config.
        model_dir: HF model directory.
    """

    name = "torch"

    def __init__(self, cfg: LocalConfig, model_dir: Path):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        grouped_keys_on_cpu()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        cuda = self.device.type == "cuda"
        self.packed = cfg.torch_base == "packed" or (cfg.torch_base == "auto" and cuda)
        want = {"auto": torch.bfloat16 if cuda else None, "float32": None, "bfloat16": torch.bfloat16}[cfg.dtype]
        self.autocast_dtype = want
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        chosen = quantize_base(model, bits=cfg.quant_bits, group_size=cfg.quant_group_size, packed=self.packed,
                               targets=cfg.lora_targets)
        self.targets = chosen.per_layer
        self.spec = LoraSpec(cfg.lora_rank, cfg.lora_alpha, peft_targets(model, chosen.paths))
        self.lora_paths = add_lora(model, self.spec, cfg.seed, chosen.paths)
        model.to(self.device)
        model.config.use_cache = False
        if cfg.gradient_checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = model
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.opt = torch.optim.AdamW(list(self.params.values()), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.sft_opt: torch.optim.AdamW | None = None
        self.engine = TorchEngine.from_model(model)
        self.temperature = cfg.temperature
        self.summary = self._summary(str(model_dir))

    # ------------------------------------------------------------------------------------------- helpers
    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def adapters_disabled(self) -> contextlib.AbstractContextManager[None]:
        """Bypass every adapter (the reference policy) inside the block."""
        return lora_disabled(self.model)

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def _logp(self, pk: Packed, hits: bool = False) -> Scores:
        """[b, T] logprobs of the packed targets (every token after the prompt: actions and observations) and,
        with ``hits``, whether the argmax equals each target (``stoa.engines.torch_scoring.score``)."""
        return score(self.model, to_device(pk, self.device), temperature=self.temperature,
                     autocast=self.autocast_dtype, hits=hits)

    @torch.no_grad()
    def _group_logp(self, batch: Batch, idx: np.ndarray) -> torch.Tensor:
        """[n, T] logprobs of one group's rows ``idx`` after their shared prompt (run once, KV rows repeated;
        ``stoa.engines.torch_scoring.group_score``)."""
        rows = [batch.rows[int(i)] for i in idx]
        return group_score(self.model, rows[0].prompt, [r.tokens for r in rows], batch.width, device=self.device,
                           temperature=self.temperature, autocast=self.autocast_dtype).logp

    @torch.no_grad()
    def _score(self, batch: Batch, micro: Sequence[np.ndarray]) -> np.ndarray:
        self.model.eval()
        out = np.zeros(batch.mask.shape, dtype=np.float32)
        for idx in micro:
            pk = pack(batch, idx)
            out[idx] = self._logp(pk)[0].float().cpu().numpy() * pk.mask
        return out

    # ------------------------------------------------------------------------------------------ protocol
    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        """Eval mode and the compute autocast, for ``self.engine``."""
        self.model.eval()
        with self._autocast():
            yield

    def generator(self, seed: int) -> torch.Generator:
        """A ``torch.Generator`` on the model's device seeded with ``seed``.

        Args:
            seed: the seed.
        """
        return torch.Generator(device=self.device).manual_seed(seed)

    def rollout(self, prompts: Sequence[Sequence[int]], n: int, *, max_new_tokens: int, temperature: float,
                top_p: float, eos_ids: Sequence[int], seed: int, greedy: bool = False
                ) -> tuple[list[list[Completion]], GenStats]:
        """Sample with the torch engine on this model (shared-prefix KV, batched decode).

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
        with self.sampling():
            groups, stats = self.engine.generate(prompts, n, max_new_tokens=max_new_tokens, temperature=temperature,
                                                 top_p=top_p, eos_ids=eos_ids, generator=self.generator(seed),
                                                 greedy=greedy)
        return groups, stats  # type: ignore[return-value]

    def logprobs(self, batch: Batch, micro: Sequence[np.ndarray]) -> np.ndarray:
        """Old-policy logprobs [B, T] from a full forward per micro-batch (0 off the mask).

        Args:
            batch: the step's batch.
            micro: row indices per micro-batch (the training step's, so the numbers are identical).
        """
        return self._score(batch, micro)

    def ref_logprobs(self, batch: Batch, micro: Sequence[np.ndarray]) -> np.ndarray:
        """Reference logprobs [B, T] with every adapter bypassed, group by group with the prompt run once.

        The KL term needs no bitwise agreement with the update's forward, so the reference uses the
        shared-prefix forward (about 1e-6 from the full one in float32), the fleet trainer's
        (``stoa.engines.torch_scoring.group_score``: every cache kind, hybrid stacks' conv and linear-attention
        states included, repeated per row).

        Args:
            batch: the step's batch.
            micro: row indices per micro-batch (unused: one forward per group).
        """
        self.model.eval()
        out = np.zeros(batch.mask.shape, dtype=np.float32)
        with self.adapters_disabled():
            for idx in group_indices(batch):
                out[idx] = self._group_logp(batch, idx).float().cpu().numpy() * batch.mask[idx]
        return out

    def accumulate(self, batch: Batch, micro: Sequence[np.ndarray], algo: Algorithm,
                   echo_alpha: float | None = None) -> dict[str, float]:
        """Forward/backward each micro-batch under the whole-batch normaliser; gradients add up.

        Multi-turn rows: ratio, clip, gate and KL see the action tokens only (``mask``); the ECHO term reads
        the logprobs of the echo tokens, and GiGPO's per-token advantages replace the per-row ones.

        Args:
            batch: the step's batch (``ref_logp`` set when kl_beta > 0). Without ``old_logp`` the old policy
                is this forward itself (detached; filled into ``batch.old_logp``).
            micro: row indices per micro-batch.
            algo: a torch ``Algorithm``.
            echo_alpha: this step's ECHO coefficient (``Algorithm.echo_coefficient``); None: the config's.
        """
        reuse = batch.old_logp is None
        echo = echo_step(batch, algo, echo_alpha)
        filled = np.zeros(batch.mask.shape, np.float32)

        def forward(idx: np.ndarray) -> MicroForward:
            logp, hits = self._logp(pack(batch, idx), echo.hits)
            return MicroForward(logp, hits, None)

        def observe(idx: np.ndarray, logp: torch.Tensor) -> None:
            filled[idx] = logp.detach().float().cpu().numpy() * batch.mask[idx]

        self.model.train()
        acc = accumulate(algo, batch, micro, forward, to=self._t, echo=echo, observe=observe, lags=False)
        if reuse:
            batch.old_logp = filled
        self.model.eval()
        out = combine_metrics(acc.parts)
        out["loss"] = acc.loss
        return out

    def grad_arrays(self) -> dict[str, np.ndarray]:
        """Accumulated adapter gradients (zeros where none flowed)."""
        return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().cpu().numpy()
                for n, p in self.params.items()}

    def apply_update(self) -> float:
        """Clip to ``grad_clip``, AdamW step, clear gradients; returns the pre-clip norm."""
        return clip_and_step(list(self.params.values()), self.opt, self.cfg.grad_clip)

    def clear_grads(self) -> None:
        """Drop accumulated gradients without stepping."""
        self.opt.zero_grad(set_to_none=True)

    def step(self, batch: Batch, micro: Sequence[np.ndarray], algo: Algorithm,
             echo_alpha: float | None = None) -> dict[str, float]:
        """``accumulate`` then ``apply_update``.

        Args:
            batch: the step's batch.
            micro: row indices per micro-batch.
            algo: a torch ``Algorithm``.
            echo_alpha: this step's ECHO coefficient; None: the config's.
        """
        out = self.accumulate(batch, micro, algo, echo_alpha)
        out["grad_norm"] = self.apply_update()
        return out

    def sft_step(self, rows: Sequence[SftRow], micro: Sequence[np.ndarray], lr: float) -> SftResult:
        """One cold-start step: cross-entropy of the action tokens under the sampling temperature (as the
        fleet trainer's cold start), the mean over the step's; a clipped AdamW step of the cold start's own
        optimizer (made on the first call; ``self.opt``, the RL one, is untouched).

        Args:
            rows: the step's rows.
            micro: row indices per micro-batch.
            lr: the cold start's learning rate.
        """
        params = list(self.params.values())
        opt = self.sft_opt
        if opt is None:
            opt = self.sft_opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        for group in opt.param_groups:
            group["lr"] = lr
        total = max(action_tokens(rows), 1)
        self.model.train()
        loss_sum = 0.0
        for idx in micro:
            pk = pack_sft([rows[int(i)] for i in idx])
            logp = score(self.model, to_device(pk, self.device, pk.mask), temperature=self.temperature,
                         autocast=self.autocast_dtype).logp
            loss = -logp.float().sum()
            (loss / total).backward()
            loss_sum += float(loss.detach())
        clip_and_step(params, opt, self.cfg.grad_clip)
        self.model.eval()
        return SftResult(loss_sum / total, action_tokens(rows))

    def adapter_arrays(self) -> dict[str, np.ndarray]:
        """Adapter weights by mlx-lm name and layout, float32 (``stoa.models.lora_torch.to_mlx_lm``)."""
        return to_mlx_lm(self.peft_arrays())

    def peft_arrays(self) -> dict[str, np.ndarray]:
        """Adapter weights by parameter name in PEFT's layout (``...lora_A.weight`` [r, in]), float32 copies."""
        return {n: p.detach().float().cpu().numpy().copy() for n, p in self.params.items()}

    def load_adapter_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Overwrite the adapters; names and shapes must match exactly.

        Args:
            arrays: name -> float32 array.
        """
        check_same_arrays(self.adapter_arrays(), arrays, "adapter")
        peft = from_mlx_lm(arrays)
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(torch.from_numpy(peft[n]).to(p.device))

    def optimizer_arrays(self) -> tuple[dict[str, np.ndarray], int]:
        """AdamW moments ``m/<name>``, ``v/<name>`` (mlx-lm names and layout, as ``adapter_arrays``) and the step
        count (zeros before the first step)."""
        out: dict[str, np.ndarray] = {}
        step = 0
        for n, p in self.params.items():
            st = self.opt.state.get(p, {})
            zero = np.zeros(tuple(p.shape), np.float32)
            m = st["exp_avg"].float().cpu().numpy() if "exp_avg" in st else zero
            v = st["exp_avg_sq"].float().cpu().numpy() if "exp_avg_sq" in st else zero
            out[f"m/{mlx_lm_name(n)}"], out[f"v/{mlx_lm_name(n)}"] = m.T.copy(), v.T.copy()
            step = int(st["step"]) if "step" in st else step
        return out, step

    def load_optimizer_arrays(self, arrays: dict[str, np.ndarray], step: int) -> None:
        """Restore AdamW moments and step.

        Args:
            arrays: ``m/<name>`` and ``v/<name>`` arrays.
            step: the optimizer's step count.
        """
        check_same_arrays(self.optimizer_arrays()[0], arrays, "optimizer")
        if step == 0:
            self.opt.state.clear()
            return
        for n, p in self.params.items():
            m, v = (np.asarray(arrays[f"{k}/{mlx_lm_name(n)}"], np.float32).T.copy() for k in ("m", "v"))
            self.opt.state[p] = {"step": torch.tensor(float(step)), "exp_avg": torch.from_numpy(m).to(p.device),
                                 "exp_avg_sq": torch.from_numpy(v).to(p.device)}

    @torch.no_grad()
    def logits_shape(self, prompt: Sequence[int]) -> tuple[int, ...]:
        """Full-vocabulary logits shape of one forward.

        Args:
            prompt: token ids.
        """
        self.model.eval()
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=self.device)
        with self._autocast():
            return tuple(self.model(input_ids=ids, use_cache=False).logits.shape)

    def peak_memory_mb(self) -> float:
        """CUDA allocator peak on CUDA; the process's resident high-water mark on CPU."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 1e6
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3

    def _summary(self, model_id: str) -> ModelSummary:
        total = sum(p.numel() for p in self.model.parameters())
        quant = [m for m in self.model.modules() if isinstance(m, QuantLinear)]
        total += sum(m.in_features * m.out_features + (0 if m.bias is None else m.out_features) for m in quant)
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        trainable = [mlx_lm_name(n) for n, _ in named]
        return ModelSummary(
            model_id=model_id, backend=self.name, layers=len(self.targets),
            quant_bits=self.cfg.quant_bits, targets_per_layer=self.targets, total_params=int(total),
            trainable_params=int(sum(p.numel() for _, p in named)), trainable_names=trainable,
            quantized_linears=len(quant),
            extra={"base_storage": "packed" if self.packed else "dequantized", "device": str(self.device)})
