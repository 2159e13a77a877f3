"""Memory preflight of the trainer: the estimated peak memory PER RANK, from config.json, before any weight loads.

The parts (``estimate_peak``; P parameters, W ranks, b rows per micro-batch, S = prompt + completion tokens;
the compute dtype is the ``dtype`` setting's, bf16 by default on CUDA and on CPUs with native bf16):

- parameters: fp32 master weights sharded 1/W (FSDP2), plus what compute holds unsharded: with W > 1 the
  all-gathered root (embedding, LM head), the block that computes and the next one (prefetch) in the compute
  dtype; with W = 1 in bf16 a bf16 copy of every weight (``compute_weights``: the persistent compute copy, or
  autocast's casts kept for backward); nothing more in fp32 at W = 1. Loading (a full fp32 copy per rank before
  sharding) is not the peak.
- gradients: fp32, sharded (P x 4 / W); optimizer: AdamW's two fp32 moments, sharded (P x 8 / W).
- activations: per layer b x S x (ACT_H x hidden + ACT_I x MLP width (MoE: the top-k experts' and a shared
  expert's) + ACT_ATTN x heads x S) values of 4
  bytes (fp32), 3 (bf16 autocast, one rank: it keeps fp32 inputs next to bf16 copies) or 2 (bf16 on the bf16
  compute copy, or sharded),
  times ACT_SCALE; with gradient checkpointing the block inputs (layers x b x S x hidden) plus CKPT_LAYERS
  blocks' worth.
- logits: the LM head runs only on the completion positions, at most ``LOGITS_CHUNK_ELEMENTS`` of them upcast
  at once (``stoa.engines.torch_scoring``): min(b x T x vocab, chunk) x 4 bytes, LOGIT_COPIES (2) of them (the
  fp32 logits and the logsumexp's buffer), plus the b x T x vocab logits in the compute dtype kept for backward
  while they fit ``LOGITS_KEEP_BYTES`` (past it they are recomputed).
- reference: the frozen reference policy's weights when kl_beta > 0: sharded fp32 with W > 1, stored in the
  compute dtype at W = 1; its forward keeps no activations. A LoRA run holds none (its reference is its own
  base with the adapters bypassed, ``stoa.trainer.policy.BaseView``).
- LoRA (``lora_rank`` > 0, L adapter parameters): the base is frozen, stored in the compute dtype at W = 1
  (fp32 sharded), the fp32 adapter is added to the parameters; gradients and AdamW moments count L instead
  of P; with ``lora_base_plane`` the decoder-block linears count 4 or 8 bits plus two bf16 values per group
  of 64 (``stoa.config.memory.quantized_base_bytes``). The overhead keeps its P term: measured on
  SmolLM2-135M (fp32, 16 rows, micro-batch 16, shared 2-core CPU) LoRA r=16 peaked at 5.23 GB against full
  fine-tuning's 5.41 GB, so the heap that term stands for is not the optimizer's (estimate 5.18 GB with it,
  4.66 GB without).
- overhead: interpreter, torch, transformers, tokenizer (CPU: the tiny model's measured peak); the CUDA context
  and workspaces on CUDA (not measured); plus STEP_BYTES_PER_PARAM x P / W for the optimizer step's temporaries
  and the heap glibc keeps after them (measured: one fp32 copy of the weights).

Calibration (docs/memory.md): peak RSS of a fresh ``stoa bench trainer`` process (SmolLM2-135M, 64 rows of
48 + 64 tokens, packed micro-batches, on-policy logprobs) on this project's 2-core Linux CPU box, torch 2.13;
ACT_SCALE, the autocast activation bytes and CKPT_LAYERS fitted on these rows:

============  =====  =====  ====  ===  ===========  ============  =====
model         dtype  micro  ckpt  KL   measured GB  estimate GB   error
============  =====  =====  ====  ===  ===========  ============  =====
smollm2-135m  fp32   16     no    no   6.70         6.71          +0%
smollm2-135m  fp32   4      no    no   3.83         4.06          +6%
smollm2-135m  fp32   16     yes   no   4.32         4.05          -6%
smollm2-135m  fp32   16     no    yes  7.31         7.25          -1%
smollm2-135m  bf16   16     no    no   5.91         6.11          +3%
smollm2-135m  bf16   4      no    no   3.71         4.11          +11%
smollm2-135m  bf16   16     yes   no   4.20         4.11          -2%
smollm2-135m  bf16   16     no    yes  6.11         6.38          +4%
smollm2-135m  copy   16     no    no   5.36         5.24          -2%
smollm2-135m  copy   16     no    .001 5.80         5.51          -5%
smollm2-135m  lean   16     no    .001 5.06         5.07          +0%
============  =====  =====  ====  ===  ===========  ============  =====

(bf16: ``compute_weights = "autocast"``; copy: the bf16 compute copy, ``bf16_copy``; lean: the copy with lean
activations, ``stoa.trainer.lean``, measured by ``benchmarks/step_profile.py``. The rows above it were measured
before lean activations and are estimated here without them.)

CUDA figures are estimates from the same constants; check them with ``--preflight`` on a GPU.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from stoa.config.memory import (
    GB,
    Candidate,
    FitReport,
    activation_bytes,
    check_fit,
    halvings,
    lora_params,
    quantized_base_bytes,
    refuse,
)
from stoa.machine import system_memory
from stoa.models.shapes import ModelShape
from stoa.tokenize import TextCodec
from stoa.weights.planes import GROUP_SIZE, QUANT_BITS

__all__ = ["Budget", "PeakEstimate", "PromptLength", "Workload", "computes_bf16", "device_budget", "estimate_peak",
           "fit", "is_cuda", "preflight", "prompt_length", "workload"]

RUNTIME_GB = {"cpu": 0.40, "cuda": 1.0}
"""Framework overhead per rank: the process baseline on CPU (measured with the tiny model); the CUDA context and
cuBLAS workspaces on CUDA (not measured)."""
STEP_BYTES_PER_PARAM = 4.0
"""Overhead per (sharded) parameter: the optimizer step's temporaries and, on CPU, the heap glibc keeps after
them; measured on SmolLM2-135M as one fp32 copy of the weights (0.5 GB) above the tiny model's baseline."""
ACT_SCALE = 1.05
"""Multiplier on the activation model fitted to the measurements (0.67, 0.73 and 0.40 with checkpointing; the
larger figure keeps the estimate on the safe side)."""
CKPT_LAYERS = 6
LEAN_NORM_BYTES = 8.0
"""Bytes per hidden value and layer that lean activations do not keep: two RMSNorms, each 4 bytes (the fp32
intermediate beyond the input it recomputes from; ``stoa.trainer.lean``)."""
"""With gradient checkpointing, blocks' worth of activations alive at the peak besides the block inputs: one
recomputed block in theory; fitted on SmolLM2 (glibc keeps the freed blocks of the recomputes)."""
LOGIT_COPIES = 2.0
"""float32 [b, T, vocab] buffers alive at the LM head's peak (besides the kept logits)."""
DEFAULT_PROMPT_TOKENS = 256
"""Prompt length assumed when the task's held-out prompts cannot be rendered offline (give --prompt-tokens)."""


class Workload(NamedTuple):
    """The shape of one rank's training work."""

    micro_batch: int
    """Rows per forward/backward."""
    prompt_tokens: int
    completion_tokens: int
    """Tokens after the prompt (max_new_tokens, or a multi-turn task's max_total_tokens)."""
    gradient_checkpointing: bool
    reference: bool
    """Whether a frozen reference policy is held (kl_beta > 0, full fine-tuning)."""
    world_size: int = 1
    cuda: bool = False
    bf16: bool = False
    """Whether forward and backward compute in bf16 (the ``dtype`` setting resolved)."""
    lora_rank: int = 0
    """The LoRA adapter's rank (0: full fine-tuning)."""
    lora_targets: tuple[str, ...] = ()
    """The module-name suffixes the adapter wraps."""
    bf16_copy: bool = False
    """Whether a bf16 rank computes on a bf16 copy of the weights (``compute_weights = "bf16_copy"``: one rank,
    full fine-tuning) rather than under autocast."""
    lean: bool = False
    """Whether the trained forward recomputes its norms' and SwiGLU's intermediates in backward
    (``stoa.trainer.lean``: one rank, without gradient checkpointing)."""
    lora_base_bits: int = 0
    """A LoRA run's quantized base (``lora_base_plane``: 8 or 4 bits per decoder-block linear weight plus bf16
    group scales and biases; 0: the base in the compute dtype)."""


@dataclass(frozen=True)
class PeakEstimate:
    """Estimated peak memory per rank in GB, by part (see the module docstring)."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    reference: float
    overhead: float

    @property
    def total(self) -> float:
        """The sum of the parts."""
        return sum(self.parts().values())

    def parts(self) -> dict[str, float]:
        """Part name -> GB."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line: the total and its parts."""
        return f"{self.total:.2f} GB (" + ", ".join(f"{k} {v:.2f}" for k, v in self.parts().items()) + ")"


def _gathered(shape: ModelShape) -> int:
    """Parameters all-gathered at once under FSDP2 (``stoa.trainer.dist``: one unit per decoder block, then the
    root): the root's (embedding, final norm, the LM head when untied; kept through forward and backward), the
    block that computes and the next one (prefetch); a MoE block is gathered with all its experts."""
    block = max(shape.layer_params(i) for i in range(shape.layers))
    return shape.vocab * shape.hidden * (1 if shape.tied else 2) + shape.hidden + 2 * block


def estimate_peak(shape: ModelShape, work: Workload) -> PeakEstimate:
    """The estimated peak memory of one trainer rank (nothing is loaded).

    Args:
        shape: the model's config.json figures (``stoa.models.shapes.shape_for``).
        work: the rank's workload.
    """
    p, w = shape.params(), max(1, work.world_size)
    from stoa.engines.torch_scoring import LOGITS_CHUNK_ELEMENTS, LOGITS_KEEP_BYTES

    cb = 2 if work.bf16 else 4  # compute bytes
    # Activation bytes per value: autocast (one rank) keeps many ops' fp32 inputs next to their bf16 copies
    # (measured: 3/4 of fp32's); the bf16 compute copy and sharded bf16 compute on bf16 parameters throughout.
    copy = work.bf16 and work.bf16_copy and w == 1 and not work.lora_rank
    ab = 4 if not work.bf16 else 2 if w > 1 or copy else 3
    if w > 1:
        gathered = _gathered(shape) * cb
    else:
        gathered = p * cb if work.bf16 else 0
    b, seq, t = work.micro_batch, work.prompt_tokens + work.completion_tokens, work.completion_tokens
    acts = activation_bytes(shape, b, seq, ab, checkpointing=work.gradient_checkpointing,
                            checkpoint_blocks=CKPT_LAYERS)
    if work.lean and w == 1 and not work.gradient_checkpointing:
        acts -= lean_saved(shape, b * seq, cb)
    trained, weights = p, p * 4 / w + gathered
    if work.lora_rank:  # a frozen base (compute dtype at W = 1) plus the fp32 adapter, which alone trains
        trained = lora_params(shape, work.lora_rank, work.lora_targets)
        weights = (p * 4 / w + gathered if w > 1 else _base_bytes(shape, cb, work.lora_base_bits)) + trained * 4 / w
    return PeakEstimate(
        parameters=weights / GB, gradients=trained * 4 / w / GB, optimizer=trained * 8 / w / GB,
        activations=acts * ACT_SCALE / GB,
        logits=(min(b * t * shape.vocab, LOGITS_CHUNK_ELEMENTS) * 4 * LOGIT_COPIES
                + (b * t * shape.vocab * cb if b * t * shape.vocab * cb <= LOGITS_KEEP_BYTES else 0)) / GB,
        reference=((p * 4 / w if w > 1 else p * cb) if work.reference else 0) / GB,
        overhead=RUNTIME_GB["cuda" if work.cuda else "cpu"] + STEP_BYTES_PER_PARAM * p / w / GB)


def _base_bytes(shape: ModelShape, compute_bytes: int, bits: int) -> float:
    """A one-rank LoRA base's bytes: every weight in the compute dtype, or with ``bits`` the decoder-block linears
    quantized as the weights plane does (``stoa.models.quant_torch``: those whose input width is a multiple of 64,
    routers included) and the rest in the compute dtype."""
    p = shape.params()
    if not bits:
        return p * compute_bytes
    n_q = sum(a * b for i in range(shape.layers) for a, b in shape.layer_linears(i).values() if a % GROUP_SIZE == 0)
    return quantized_base_bytes(n_q, bits, GROUP_SIZE, 2) + (p - n_q) * compute_bytes


def lean_saved(shape: ModelShape, tokens: int, compute_bytes: int) -> float:
    """Activation bytes lean activations do not keep for ``tokens`` tokens of a forward: per layer the norms'
    fp32 intermediates (LEAN_NORM_BYTES x hidden) and, in a dense SwiGLU MLP, ``act(gate)`` (compute bytes x MLP
    width; MoE layers keep theirs).

    Args:
        shape: the model's shape.
        tokens: tokens per forward (rows x sequence).
        compute_bytes: bytes per value the forward computes in.
    """
    dense = sum(shape.intermediate for i in range(shape.layers) if not shape.is_moe(i))
    return tokens * (shape.layers * LEAN_NORM_BYTES * shape.hidden + dense * compute_bytes)


def workload(cfg: Any, prompt_tokens: int, completion_tokens: int, world_size: int, cuda: bool,
             bf16: bool = False) -> Workload:
    """A trainer config's workload per rank.

    Args:
        cfg: the ``TrainerConfig`` (or any ``TrainingConfig`` with ``shared_prefix``).
        prompt_tokens: the longest prompt (``prompt_length``).
        completion_tokens: tokens after the prompt.
        world_size: ranks.
        cuda: whether the ranks compute on CUDA.
        bf16: whether they compute in bf16 (on a bf16 copy of the weights when ``cfg.compute_weights`` says so).
    """
    rows = cfg.groups_per_step * cfg.n_samples
    micro = min(cfg.micro_batch or rows, rows)
    if getattr(cfg, "shared_prefix", False) and not cfg.gradient_checkpointing:
        micro = cfg.n_samples  # one group per forward, its prompt once
    rank = int(getattr(cfg, "lora_rank", 0))
    targets = tuple(t.strip() for t in getattr(cfg, "lora_targets", "").split(",") if t.strip()) if rank else ()
    copy = bf16 and getattr(cfg, "compute_weights", "autocast") == "bf16_copy"
    return Workload(micro, prompt_tokens, completion_tokens, cfg.gradient_checkpointing,
                    cfg.algo_config().kl_beta > 0 and not rank, world_size, cuda, bf16, rank, targets, copy,
                    lean=world_size == 1 and not cfg.gradient_checkpointing,
                    lora_base_bits=QUANT_BITS.get(getattr(cfg, "lora_base_plane", ""), 0) if rank else 0)


class Budget(NamedTuple):
    """The memory a rank may use."""

    gb: float
    """Device memory in GB (CPU: the machine's RAM, which its ranks share)."""
    source: str
    shared_by: int = 1
    """Ranks on this machine sharing ``gb`` (CPU); 1 for a GPU per rank or a per-rank override."""

    def per_rank(self, world_size: int) -> float:
        """GB one rank may use when ``world_size`` ranks run (CPU: split among this machine's ranks).

        Args:
            world_size: ranks of the run.
        """
        return self.gb / (world_size if self.shared_by > 1 else 1)


def device_budget(cfg: Any, world_size: int) -> Budget:
    """The memory per rank: ``available_memory_gb`` when set, the free memory of this rank's GPU, or the RAM.

    Args:
        cfg: the trainer config (``available_memory_gb``, ``device``).
        world_size: ranks on this machine (CPU ranks share the RAM).
    """
    if cfg.available_memory_gb > 0:
        return Budget(cfg.available_memory_gb, "available_memory_gb")
    if is_cuda(cfg.device):
        import torch

        local = os.environ.get("LOCAL_RANK") if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 else None
        index = int(local) if local else int(cfg.device.split(":")[1]) if ":" in cfg.device else 0  # as init_dist
        free, _ = torch.cuda.mem_get_info(index)
        return Budget(free / GB, f"free memory of cuda:{index}")

    gb, source = system_memory()
    return Budget(gb, source, shared_by=max(1, world_size))


def computes_bf16(dtype: str, cuda: bool) -> bool:
    """Whether the trainer computes in bf16 (the ``dtype`` setting resolved as ``compute_dtype`` does).

    Args:
        dtype: the ``dtype`` setting.
        cuda: whether it runs on CUDA.
    """
    import torch

    from stoa.trainer.policy import compute_dtype

    return compute_dtype(dtype, torch.device("cuda" if cuda else "cpu")) == torch.bfloat16


def is_cuda(device: str) -> bool:
    """Whether the trainer computes on CUDA (``auto`` resolves as the trainer does).

    Args:
        device: the ``device`` setting.
    """
    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    import torch

    return torch.cuda.is_available()


class PromptLength(NamedTuple):
    """The longest prompt and where the figure came from."""

    tokens: int
    source: str


def prompt_length(task: Any, model_dir: Path | None, n: int = 256) -> PromptLength:
    """The longest of the task's first ``n`` held-out prompts, rendered with the model's chat template.

    Args:
        task: the run's task.
        model_dir: the model's directory (its tokenizer); None: ``DEFAULT_PROMPT_TOKENS``.
        n: held-out prompts to render.
    """
    if model_dir is None:
        return PromptLength(DEFAULT_PROMPT_TOKENS, "a guess: no tokenizer offline, give --prompt-tokens")

    codec = TextCodec(model_dir)
    prompts = task.heldout(n)
    return PromptLength(max(len(codec.encode_prompt(p.messages)) for p in prompts),
                        f"longest of {len(prompts)} held-out prompts")


def _knobs(cfg: Any, max_world: int) -> Any:
    """Workload -> each knob's settings in order of preference: a smaller micro-batch, gradient checkpointing,
    more ranks (doubling up to ``max_world``), no reference."""
    shared = getattr(cfg, "shared_prefix", False) and not cfg.gradient_checkpointing  # one group per pass

    def knobs(w: Workload) -> list[list[Candidate[Workload]]]:
        micro = [] if shared else [Candidate("micro_batch", f"--micro-batch {m}", w._replace(micro_batch=m))
                                   for m in halvings(w.micro_batch)]
        rows = cfg.groups_per_step * cfg.n_samples  # checkpointing ends a shared-prefix run's one group per pass
        ckpt = [] if w.gradient_checkpointing else [Candidate(
            "gradient_checkpointing", "--gradient-checkpointing",
            w._replace(gradient_checkpointing=True,
                       micro_batch=min(cfg.micro_batch or rows, rows) if shared else w.micro_batch))]
        ranks, n = [], w.world_size * 2
        while n <= max_world:
            ranks.append(Candidate("nproc", f"--nproc {n}", w._replace(world_size=n)))
            n *= 2
        kl = [Candidate("kl_beta", "--kl-beta 0", w._replace(reference=False))] if w.reference else []
        return [micro, ckpt, ranks, kl]

    return knobs


def fit(cfg: Any, shape: ModelShape, base: Workload, budget: Budget, max_world: int = 8
        ) -> FitReport[Workload, PeakEstimate]:
    """Estimate ``base`` against the memory per rank and, when it does not fit, find the preferred change
    (``stoa.config.memory.check_fit``): a smaller micro-batch (the largest that fits), gradient checkpointing,
    more ranks (up to ``max_world``), kl_beta 0; then the knobs together.

    Args:
        cfg: the trainer config ``base`` was built from (``workload``).
        shape: the model's shape.
        base: the rank's workload.
        budget: the memory per rank (``device_budget``).
        max_world: the most ranks a fix may name.
    """
    return check_fit(base, lambda w: estimate_peak(shape, w), lambda w: budget.per_rank(w.world_size),
                     _knobs(cfg, max_world), source=budget.source, scope=f" per rank ({base.world_size} rank(s))",
                     dead_end="not even at micro-batch 1 with gradient checkpointing, no reference and the most ranks "
                              "here; use more GPUs or a smaller model (--no-preflight skips this check)")


def preflight(cfg: Any, report: FitReport[Workload, PeakEstimate]) -> None:
    """Raise when the estimate does not fit and ``cfg.preflight`` is on.

    Args:
        cfg: the trainer config.
        report: its ``fit``.

    Raises:
        MemoryPreflightError: naming the knob of the fix (``preflight`` when none fits).
    """
    refuse(report, cfg.preflight)
