"""Memory preflight: estimate a local run's peak memory from config.json before any weight loads; refuse with a knob."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoa.config import ConfigError
from stoa.config.local import DENSE_TARGETS, LocalConfig, lora_target_names, resolve_backend

GB = 1e9

KNOWN_SHAPES: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-0.6B": {"model_type": "qwen3", "num_hidden_layers": 28, "hidden_size": 1024,
                        "intermediate_size": 3072, "vocab_size": 151936, "num_attention_heads": 16,
                        "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True,
                        "max_position_embeddings": 40960},
    "Qwen/Qwen2.5-0.5B-Instruct": {"model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896,
                                   "intermediate_size": 4864, "vocab_size": 151936, "num_attention_heads": 14,
                                   "num_key_value_heads": 2, "tie_word_embeddings": True,
                                   "max_position_embeddings": 32768},
    "HuggingFaceTB/SmolLM2-135M-Instruct": {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576,
                                            "intermediate_size": 1536, "vocab_size": 49152,
                                            "num_attention_heads": 9, "num_key_value_heads": 3,
                                            "tie_word_embeddings": True, "max_position_embeddings": 8192},
}
"""config.json figures of a few hub models, so a preflight (and --dry-run) works before anything is downloaded."""
KNOWN_SHAPES["smollm2-135m"] = KNOWN_SHAPES["HuggingFaceTB/SmolLM2-135M-Instruct"]
KNOWN_SHAPES["mlx-community/Qwen3-0.6B-4bit"] = KNOWN_SHAPES["Qwen/Qwen3-0.6B"]

# ---- calibration (docs/local.md, "Memory"): figures MEASURED on this project's Linux CPU box (2 cores) as the
# peak resident set of a fresh `stoa local train` process; the runtime baselines are those processes' RSS
# after imports and the tokenizer, before the model. Metal figures are estimates (see the docs).
RUNTIME_GB = {"torch": 0.40, "mlx": 0.38}
"""Process baseline: interpreter, torch or mlx + mlx-lm, transformers, tokenizer (measured)."""
ACT_H, ACT_I, ACT_ATTN = 10.0, 5.0, 2.0
"""Saved activations per token and layer in a LoRA backward: ~ACT_H x hidden + ACT_I x intermediate values,
plus ACT_ATTN x heads x L attention scores per token (fitted to the measurements)."""
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
class ModelShape:
    """The config.json figures the estimate needs."""

    name: str
    model_type: str
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    max_positions: int
    hybrid: bool = False

    @classmethod
    def from_config(cls, name: str, c: dict[str, Any]) -> ModelShape:
        """Read a config.json dict (text_config nested configs are unwrapped).

        Args:
            name: the model name, for messages.
            c: the parsed config.json.
        """
        c = {**c.get("text_config", {}), **{k: v for k, v in c.items() if k != "text_config"}}
        try:
            heads = int(c["num_attention_heads"])
            hidden = int(c["hidden_size"])
            types = c.get("layer_types") or []
            return cls(
                name=name, model_type=str(c.get("model_type", "?")), layers=int(c["num_hidden_layers"]),
                hidden=hidden, intermediate=int(c["intermediate_size"]), vocab=int(c["vocab_size"]), heads=heads,
                kv_heads=int(c.get("num_key_value_heads") or heads), head_dim=int(c.get("head_dim") or hidden // heads),
                tied=bool(c.get("tie_word_embeddings", False)),
                max_positions=int(c.get("max_position_embeddings") or 1 << 20),
                hybrid=any("linear" in str(t) for t in types))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{name}: config.json lacks a figure the memory estimate needs ({e})") from None

    def block_linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each dense decoder-block projection."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def params(self) -> int:
        """Total parameters (embeddings, blocks, norms, and the LM head when untied)."""
        block = sum(a * b for a, b in self.block_linears().values()) + 2 * self.hidden
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * block + self.hidden


def shape_for(model: str) -> ModelShape | None:
    """The model's shape without downloading anything: a local dir, a built-in, the HF cache or ``KNOWN_SHAPES``.

    Args:
        model: the ``model`` setting.

    Returns:
        the shape, or None when no config.json is reachable offline (resolve the model, then ``shape_from_dir``).
    """
    from stoa.models import KNOWN_MODELS, default_cache_dir

    local = Path(model).expanduser()
    if (local / "config.json").is_file():
        return shape_from_dir(local, model)
    if model in KNOWN_MODELS:
        from stoa.models.registry import SMOLLM2_DIR, resolve_model

        cached = default_cache_dir() / "models" / SMOLLM2_DIR
        if model == "smollm2-135m" and not (cached / "config.json").is_file():
            return ModelShape.from_config(model, KNOWN_SHAPES[model])
        return shape_from_dir(cached if model == "smollm2-135m" else resolve_model(model), model)
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(model, "config.json")
        if isinstance(hit, str):
            return ModelShape.from_config(model, json.loads(Path(hit).read_text()))
    except (ImportError, ValueError, OSError):
        pass
    if model in KNOWN_SHAPES:
        return ModelShape.from_config(model, KNOWN_SHAPES[model])
    return None


def shape_from_dir(model_dir: Path, name: str = "") -> ModelShape:
    """Read ``model_dir/config.json``.

    Args:
        model_dir: an HF model directory.
        name: display name (default: the directory).
    """
    return ModelShape.from_config(name or str(model_dir), json.loads((Path(model_dir) / "config.json").read_text()))


@dataclass(frozen=True)
class Estimate:
    """A peak-memory estimate in GB with its parts."""

    total_gb: float
    parts: dict[str, float]
    peak_phase: str

    def describe(self) -> str:
        """One line: total and parts."""
        parts = ", ".join(f"{k} {v:.2f}" for k, v in self.parts.items())
        return f"{self.total_gb:.2f} GB at the {self.peak_phase} peak ({parts})"


def _adapted(cfg: LocalConfig, shape: ModelShape) -> dict[str, tuple[int, int]]:
    names = lora_target_names(cfg.lora_targets)
    lin = shape.block_linears()
    if names in (("auto",), ("all-linear",)):
        return {k: v for k, v in lin.items() if k in DENSE_TARGETS}
    return {k: v for k, v in lin.items() if k in names or any(n.endswith("." + k) for n in names)}


def estimate_memory(cfg: LocalConfig, shape: ModelShape, backend: str | None = None) -> Estimate:
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
    """
    be = backend or resolve_backend(cfg.backend)
    cuda = be == "torch" and cfg.device.startswith("cuda")
    if be == "mlx":
        cb = 4 if cfg.dtype == "float32" or (cfg.dtype == "auto" and not _metal()) else 2
    else:
        cb = 4
    act_b = 2 if (be == "torch" and (cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and cuda))) else cb
    lin = shape.block_linears()
    gs, bits = cfg.quant_group_size, cfg.quant_bits
    n_quant = shape.layers * sum(a * b for a, b in lin.values() if a % gs == 0) if bits < 16 else 0
    n_float = shape.params() - n_quant
    packed = cfg.torch_base == "packed" or (cfg.torch_base == "auto" and cuda)
    if be == "mlx":
        weights = n_quant * (bits / 8 + 2 * cb / gs) + n_float * cb
    elif packed:
        weights = n_quant * (bits / 8 + 8 / gs) + n_float * 4
        if not cuda:  # the checkpoint's pages stay resident after quantization (mmap)
            weights += TORCH_LOAD_BYTES_PER_PARAM / 2 * shape.params()
    else:
        weights = TORCH_LOAD_BYTES_PER_PARAM * shape.params()
    lora = shape.layers * sum(cfg.lora_rank * (a + b) for a, b in _adapted(cfg, shape).values())
    adapters = lora * 4 * 5
    rows = cfg.groups_per_step * cfg.n_samples
    seq = cfg.max_prompt_tokens + cfg.max_new_tokens
    kv_len = math.ceil(seq / 256) * 256 if be == "mlx" else seq
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * kv_len * rows * act_b
    rollout = kv + rows * shape.vocab * 4 * ROLLOUT_LOGITS_COPIES
    b = rows if cfg.micro_batch == 0 else min(cfg.micro_batch, rows)
    per_layer = b * seq * (ACT_H * shape.hidden + ACT_I * shape.intermediate + ACT_ATTN * shape.heads * seq) * act_b
    if cfg.gradient_checkpointing:
        acts = shape.layers * b * seq * shape.hidden * act_b + per_layer
    else:
        acts = shape.layers * per_layer
    train = (acts + b * cfg.max_new_tokens * shape.vocab * 4 * HEAD_COPIES) * BACKEND_ACT_SCALE[be]
    dynamic = SLACK * max(rollout, train)
    parts = {"runtime": RUNTIME_GB["mlx" if be == "mlx" else "torch"], "weights": weights / GB,
             "adapters": adapters / GB, "rollout": rollout * SLACK / GB, "train": train * SLACK / GB}
    total = parts["runtime"] + parts["weights"] + parts["adapters"] + dynamic / GB
    return Estimate(total, parts, "train" if train >= rollout else "rollout")


def _metal() -> bool:
    from stoa.config.local import is_apple_silicon

    return is_apple_silicon()


def available_memory_gb(cfg: LocalConfig) -> tuple[float, str]:
    """The memory the run may use: ``available_memory_gb`` when set, else the machine's (cgroup-aware).

    Args:
        cfg: the run's config.
    """
    if cfg.available_memory_gb > 0:
        return cfg.available_memory_gb, "available_memory_gb"
    from stoa.machine import system_memory

    return system_memory()


class MemoryPreflightError(ConfigError):
    """The run is estimated not to fit; ``field`` is the knob most likely to make it fit."""


@dataclass(frozen=True)
class FitReport:
    """Whether a config fits, and if not, the first knob change that does."""

    fits: bool
    estimate: Estimate
    available_gb: float
    source: str
    knob: str | None = None
    suggestion: str = ""
    suggested: LocalConfig | None = None

    def message(self) -> str:
        """The human-readable verdict."""
        head = f"estimated peak memory {self.estimate.describe()}; available {self.available_gb:.2f} GB ({self.source})"
        if self.fits:
            return head + ": fits"
        return head + f": does not fit; {self.suggestion}"


def _fits(c: LocalConfig, shape: ModelShape, be: str, avail: float) -> tuple[bool, Estimate]:
    e = estimate_memory(c, shape, be)
    return e.total_gb <= avail, e


def _halvings(value: int, floor: int) -> list[int]:
    out, v = [], value // 2
    while v >= floor:
        out.append(v)
        v //= 2
    if value > floor and (not out or out[-1] != floor):
        out.append(floor)
    return out


def check_fit(cfg: LocalConfig, shape: ModelShape, available_gb: float | None = None,
              source: str = "") -> FitReport:
    """Estimate and, when it does not fit, find the knob most likely to make it fit.

    Knobs are tried in order, each alone: gradient checkpointing, then the micro-batch (it does not change
    the update), then the group size G, then the completion length; if no single knob suffices they are
    combined in that order.

    Args:
        cfg: the run's config.
        shape: the model's shape.
        available_gb: the budget (default: ``available_memory_gb``).
        source: where the budget came from, for the message.
    """
    be = resolve_backend(cfg.backend)
    if available_gb is None:
        available_gb, source = available_memory_gb(cfg)
    ok, est = _fits(cfg, shape, be, available_gb)
    if ok:
        return FitReport(True, est, available_gb, source)
    rows = cfg.groups_per_step * cfg.n_samples
    micro = cfg.micro_batch or rows

    def options(c: LocalConfig) -> list[tuple[str, list[LocalConfig]]]:
        return [
            ("gradient_checkpointing", [] if c.gradient_checkpointing else
             [dataclasses.replace(c, gradient_checkpointing=True)]),
            ("micro_batch", [dataclasses.replace(c, micro_batch=m)
                             for m in _halvings(min(c.micro_batch or rows, micro), 1)]),
            ("n_samples", [dataclasses.replace(c, n_samples=g) for g in _halvings(c.n_samples, 2)]),
            ("max_new_tokens", [dataclasses.replace(c, max_new_tokens=t) for t in _halvings(c.max_new_tokens, 16)]),
        ]

    for knob, candidates in options(cfg):
        for c in candidates:
            fit, e = _fits(c, shape, be, available_gb)
            if fit:
                value = getattr(c, knob)
                return FitReport(False, est, available_gb, source, knob,
                                 f"most likely to fit: {knob} = {_show(value)} (estimate {e.total_gb:.2f} GB)", c)
    combo, changes = cfg, []
    for knob, _ in options(cfg):
        cands = dict(options(combo))[knob]
        if not cands:
            continue
        combo = cands[-1]
        changes.append(f"{knob} = {_show(getattr(combo, knob))}")
        fit, e = _fits(combo, shape, be, available_gb)
        if fit:
            return FitReport(False, est, available_gb, source, changes[0].split(" ")[0],
                             f"no single knob fits; together: {', '.join(changes)} (estimate {e.total_gb:.2f} GB)",
                             combo)
    floor = est.parts["runtime"] + est.parts["weights"]
    return FitReport(False, est, available_gb, source, "model",
                     f"the model alone needs about {floor:.2f} GB with quant_bits = {cfg.quant_bits}; use "
                     "quant_bits = 4 or a smaller model")


def _show(v: Any) -> str:
    return "true" if v is True else str(v)


def preflight(cfg: LocalConfig, shape: ModelShape) -> FitReport:
    """Check the sequence length against the model and the memory estimate against the budget.

    Args:
        cfg: the run's config.
        shape: the model's shape.

    Raises:
        ConfigError: 'max_new_tokens' when prompt plus completion exceed the model's positions.
        MemoryPreflightError: when the estimate exceeds the budget; names the suggested knob.
    """
    if cfg.max_prompt_tokens + cfg.max_new_tokens > shape.max_positions:
        total = cfg.max_prompt_tokens + cfg.max_new_tokens
        raise ConfigError("max_new_tokens", f"max_prompt_tokens + max_new_tokens = {total} "
                                        f"exceeds the model's {shape.max_positions} positions")
    report = check_fit(cfg, shape)
    if not report.fits and cfg.preflight:
        raise MemoryPreflightError(report.knob or "available_memory_gb", report.message())
    return report
