"""Memory preflight: estimate a local run's peak memory from config.json before any weight loads; refuse with a knob."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from stoa.config import ConfigError
from stoa.config.local import LocalConfig, is_apple_silicon, resolve_backend
from stoa.config.memory import GB, Candidate, FitReport, activation_bytes, check_fit, halvings, refuse
from stoa.local.targets import choose_targets, is_router
from stoa.machine import system_memory
from stoa.models.shapes import ModelShape
from stoa.tasks import parse_task_spec
from stoa.tasks.multiturn import is_multiturn

__all__ = ["Estimate", "adapter_params", "available_memory_gb", "episode_tokens", "estimate_memory", "fit",
           "preflight", "quantized_params"]


# ---- calibration (docs/local.md, "Memory"): figures MEASURED on this project's Linux CPU box (2 cores) as the
# peak resident set of a fresh `stoa local train` process; the runtime baselines are those processes' RSS
# after imports and the tokenizer, before the model. Metal figures are estimates (see the docs).
RUNTIME_GB = {"torch": 0.40, "mlx": 0.38}
"""Process baseline: interpreter, torch or mlx + mlx-lm, transformers, tokenizer (measured)."""
HEAD_COPIES = 6.0
"""float32 [tokens, vocab] buffers alive at the LM head's peak (logits, log-softmax, their gradients)."""
ROLLOUT_LOGITS_COPIES = 4.0
"""float32 [rows, vocab] buffers per decode step (logits, sampling log-probs, probabilities, sort)."""
BACKEND_ACT_SCALE = {"torch": 1.0, "mlx": 0.65}
"""MLX keeps fewer bytes per token than torch for the same training forward (measured ratio ~0.65 on SmolLM2)."""
TORCH_LOAD_BYTES_PER_PARAM = 8.0
"""Measured resident bytes per parameter after the torch backend builds on CPU (dequantized base): the float32
copy it computes with plus the checkpoint pages read (memory-mapped) while quantizing (SmolLM2: 1.09 GB)."""
SLACK = 1.15
"""Multiplier on the dynamic (rollout / training) part: allocator fragmentation and transient copies."""


@dataclass(frozen=True)
class Estimate:
    """A peak-memory estimate in GB with its parts."""

    total_gb: float
    parts: dict[str, float]
    peak_phase: str

    @property
    def total(self) -> float:
        """GB at the peak (``total_gb``)."""
        return self.total_gb

    def describe(self) -> str:
        """One line: total and parts."""
        parts = ", ".join(f"{k} {v:.2f}" for k, v in self.parts.items())
        return f"{self.total_gb:.2f} GB at the {self.peak_phase} peak ({parts})"


def adapter_params(cfg: LocalConfig, shape: ModelShape) -> int:
    """LoRA parameters of the run: per layer, ``rank * (in + out)`` of each linear ``lora_targets`` picks
    (``stoa.local.targets.choose_targets`` on the paths the backends use, so MoE and hybrid layers count
    exactly what gets adapters).

    Args:
        cfg: the run's config.
        shape: the model's shape.
    """
    linears = [shape.layer_linears(i) for i in range(shape.layers)]
    try:
        chosen = choose_targets([list(lin) for lin in linears], cfg.lora_targets)
    except ValueError as e:
        raise ConfigError("lora_targets", str(e).removeprefix("lora_targets: ")) from None
    return sum(cfg.lora_rank * sum(lin[p]) for lin, paths in zip(linears, chosen, strict=True) for p in paths)


def quantized_params(shape: ModelShape, group_size: int, experts_only: bool = False) -> int:
    """Parameters the QLoRA base quantizes: block linears and experts whose input width is a multiple of
    ``group_size``, never routers (``stoa.local.targets``).

    Args:
        shape: the model's shape.
        group_size: the quantization group size.
        experts_only: count the routed experts only.
    """
    n = 0
    for i in range(shape.layers):
        if not experts_only:
            n += sum(a * b for p, (a, b) in shape.layer_linears(i).items() if a % group_size == 0 and not is_router(p))
        n += shape.experts * sum(a * b for a, b in shape.expert_linears(i).values() if a % group_size == 0)
    return n


def episode_tokens(task: Any) -> int | None:
    """Tokens a multi-turn task's row holds after its prompt (its ``max_total_tokens``: every turn and
    observation); None for a single-turn task (``max_new_tokens`` then).

    Args:
        task: the run's task.
    """

    return int(task.limits.max_total_tokens) if is_multiturn(task) else None


def estimate_memory(cfg: LocalConfig, shape: ModelShape, backend: str | None = None,
                    total_tokens: int | None = None) -> Estimate:
    """Peak memory of a local run from the model's shape and the config (no model is loaded).

    weights: quantized decoder linears (codes plus per-group scale and bias), float embeddings and head;
    the torch backend additionally holds float32 copies while loading, and keeps them with
    ``torch_base = dequantized``. adapters: LoRA weights, gradients, their accumulator and AdamW's two
    moments. rollout: the batch's KV cache at full length plus decode logits. train: one micro-batch's saved
    activations (per layer, or one layer's plus the layer inputs with gradient checkpointing) and the LM
    head's float32 logits and gradients. The peak is the runtime baseline + weights + adapters + the larger
    of rollout and train.

    Args:
        cfg: the run's config.
        shape: the model's shape.
        backend: 'torch' or 'mlx' (default: the config's, resolved).
        total_tokens: tokens after the prompt of a multi-turn row (``episode_tokens``); None: ``max_new_tokens``.
    """
    be = backend or resolve_backend(cfg.backend)
    gen = cfg.max_new_tokens if total_tokens is None else total_tokens
    cuda = be == "torch" and cfg.device.startswith("cuda")
    if be == "mlx":
        cb = 4 if cfg.dtype == "float32" or (cfg.dtype == "auto" and not _metal()) else 2
    else:
        cb = 4
    act_b = 2 if (be == "torch" and (cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and cuda))) else cb
    gs, bits = cfg.quant_group_size, cfg.quant_bits
    n_quant = quantized_params(shape, gs) if bits < 16 else 0
    n_float = shape.params() - n_quant
    packed = cfg.torch_base == "packed" or (cfg.torch_base == "auto" and cuda)
    if be == "mlx":
        weights = n_quant * (bits / 8 + 2 * cb / gs) + n_float * cb
    elif packed:
        weights = n_quant * (bits / 8 + 8 / gs) + n_float * 4
        if bits < 16:  # torch holds routed experts dequantized (float32) even when packed
            weights += quantized_params(shape, gs, experts_only=True) * (4 - bits / 8 - 8 / gs)
        if not cuda:  # the checkpoint's pages stay resident after quantization (mmap)
            weights += TORCH_LOAD_BYTES_PER_PARAM / 2 * shape.params()
    else:
        weights = TORCH_LOAD_BYTES_PER_PARAM * shape.params()
    lora = adapter_params(cfg, shape)
    adapters = lora * 4 * 5
    rows = cfg.groups_per_step * cfg.n_samples
    seq = cfg.max_prompt_tokens + gen
    kv_len = math.ceil(seq / 256) * 256 if be == "mlx" else seq
    kv = 2 * shape.attention_layers() * shape.kv_heads * shape.head_dim * kv_len * rows * act_b
    kv += shape.state_values_per_row() * rows * act_b  # conv / linear-attention state: fixed size per row
    rollout = kv + rows * shape.vocab * 4 * ROLLOUT_LOGITS_COPIES
    b = rows if cfg.micro_batch == 0 else min(cfg.micro_batch, rows)
    acts = activation_bytes(shape, b, seq, act_b, checkpointing=cfg.gradient_checkpointing, checkpoint_blocks=1,
                            attention_share=True)  # hybrids: fewer attention layers keep scores
    train = (acts + b * gen * shape.vocab * 4 * HEAD_COPIES) * BACKEND_ACT_SCALE[be]
    dynamic = SLACK * max(rollout, train)
    parts = {"runtime": RUNTIME_GB["mlx" if be == "mlx" else "torch"], "weights": weights / GB,
             "adapters": adapters / GB, "rollout": rollout * SLACK / GB, "train": train * SLACK / GB}
    total = parts["runtime"] + parts["weights"] + parts["adapters"] + dynamic / GB
    return Estimate(total, parts, "train" if train >= rollout else "rollout")


def _metal() -> bool:

    return is_apple_silicon()


def available_memory_gb(cfg: LocalConfig) -> tuple[float, str]:
    """The memory the run may use: ``available_memory_gb`` when set, else the machine's (cgroup-aware).

    Args:
        cfg: the run's config.
    """
    if cfg.available_memory_gb > 0:
        return cfg.available_memory_gb, "available_memory_gb"

    return system_memory()


def _knobs(start: LocalConfig, total: int | None) -> Any:
    """Config -> each knob's settings, smallest change first: gradient checkpointing, the micro-batch (it does not
    change the update), the group size G, the completion length (a multi-turn task's ``max_total_tokens``)."""
    rows = start.groups_per_step * start.n_samples
    micro = start.micro_batch or rows
    rep = dataclasses.replace

    def knobs(c: LocalConfig) -> list[list[Candidate[LocalConfig]]]:
        if total is None:
            length = [Candidate("max_new_tokens", f"max_new_tokens = {v}", rep(c, max_new_tokens=v))
                      for v in halvings(c.max_new_tokens, 16)]
        else:
            length = [Candidate("max_total_tokens", f"max_total_tokens = {v}",
                                _with_task_option(c, "max_total_tokens", v))
                      for v in halvings(_length(c, start, total), 16)]
        return [
            [] if c.gradient_checkpointing else
            [Candidate("gradient_checkpointing", "gradient_checkpointing = true", rep(c, gradient_checkpointing=True))],
            [Candidate("micro_batch", f"micro_batch = {m}", rep(c, micro_batch=m))
             for m in halvings(min(c.micro_batch or rows, micro), 1)],
            [Candidate("n_samples", f"n_samples = {g}", rep(c, n_samples=g)) for g in halvings(c.n_samples, 2)],
            length,
        ]

    return knobs


def _total(c: LocalConfig, start: LocalConfig, total: int | None) -> int | None:
    """A multi-turn row's tokens after the prompt under ``c`` (None: single-turn)."""
    return None if total is None else _length(c, start, total)


def _length(c: LocalConfig, start: LocalConfig, total: int) -> int:
    """A multi-turn row's tokens after the prompt under ``c``: the task option the length knob set, else
    ``total`` (the start's)."""
    if c.task == start.task:
        return total
    return int(str(parse_task_spec(c.task)[1]["max_total_tokens"]))


def _with_task_option(cfg: LocalConfig, name: str, value: int) -> LocalConfig:
    """``cfg`` with one option of its task spec set (``walk:max_total_tokens=128``)."""
    task, options = parse_task_spec(cfg.task)
    options[name] = value
    return dataclasses.replace(cfg, task=f"{task}:" + ",".join(f"{k}={v}" for k, v in options.items()))


def fit(cfg: LocalConfig, shape: ModelShape, available_gb: float | None = None, source: str = "",
        total_tokens: int | None = None) -> FitReport[LocalConfig, Estimate]:
    """Estimate and, when it does not fit, find the knob most likely to make it fit
    (``stoa.config.memory.check_fit``).

    Knobs are tried in order, each alone: gradient checkpointing, then the micro-batch (it does not change
    the update), then the group size G, then the completion length (a multi-turn task's ``max_total_tokens``
    option); if no single knob suffices they are combined in that order.

    Args:
        cfg: the run's config.
        shape: the model's shape.
        available_gb: the budget (default: ``available_memory_gb``).
        source: where the budget came from, for the message.
        total_tokens: a multi-turn row's tokens after the prompt (``episode_tokens``); None: single-turn.
    """
    be = resolve_backend(cfg.backend)
    if available_gb is None:
        available_gb, source = available_memory_gb(cfg)
    base = estimate_memory(cfg, shape, be, total_tokens)
    floor = base.parts["runtime"] + base.parts["weights"]
    return check_fit(cfg, lambda c: estimate_memory(c, shape, be, _total(c, cfg, total_tokens)), lambda c: available_gb,
                     _knobs(cfg, total_tokens), source=source, refuse_as="model",
                     dead_end=f"the model alone needs about {floor:.2f} GB with quant_bits = {cfg.quant_bits}; use "
                              "quant_bits = 4 or a smaller model")


def preflight(cfg: LocalConfig, shape: ModelShape, total_tokens: int | None = None) -> FitReport[LocalConfig, Estimate]:
    """Check the sequence length against the model and the memory estimate against the budget.

    Args:
        cfg: the run's config.
        shape: the model's shape.
        total_tokens: a multi-turn row's tokens after the prompt (``episode_tokens``); None: single-turn.

    Raises:
        ConfigError: 'max_new_tokens' (a multi-turn task: 'task') when prompt plus completion exceed the
            model's positions.
        MemoryPreflightError: when the estimate exceeds the budget; names the suggested knob.
    """
    gen = cfg.max_new_tokens if total_tokens is None else total_tokens
    if cfg.max_prompt_tokens + gen > shape.max_positions:
        total = cfg.max_prompt_tokens + gen
        if total_tokens is not None:
            shorter = _with_task_option(cfg, "max_total_tokens", max(1, shape.max_positions - cfg.max_prompt_tokens))
            raise ConfigError("task", f"max_prompt_tokens + the task's max_total_tokens = {total} exceeds the "
                                      f"model's {shape.max_positions} positions; lower the task option "
                                      f"(e.g. task = {shorter.task!r}) or max_prompt_tokens")
        raise ConfigError("max_new_tokens", f"max_prompt_tokens + max_new_tokens = {total} "
                                        f"exceeds the model's {shape.max_positions} positions")
    report = fit(cfg, shape, total_tokens=total_tokens)
    refuse(report, cfg.preflight)
    return report
