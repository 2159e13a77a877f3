"""LocalConfig: the frozen, validated settings of ``stoa local train`` (TOML file, then CLI flags)."""

from __future__ import annotations

import dataclasses
import platform
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stoa.config import ConfigError, load_config, read_toml_settings

BACKENDS = ("auto", "mlx", "torch")
QUANT_BITS = (4, 8, 16)
QUANT_GROUP_SIZES = (32, 64, 128)
DTYPES = ("auto", "float32", "bfloat16")
TORCH_BASE = ("auto", "dequantized", "packed")
OLD_LOGPROBS = ("forward", "reuse")
DENSE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""What ``lora_targets = "auto"`` adapts in a dense decoder block (attention and MLP projections)."""

IDENTITY_FIELDS = ("backend", "model", "quant_bits", "quant_group_size", "lora_rank", "lora_alpha", "lora_targets")
"""Fields a resumed run must share with the run that wrote the checkpoint (they shape the adapters)."""

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


def _f(default: Any, help: str) -> Any:
    if isinstance(default, dict):
        return field(default_factory=dict, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class LocalConfig:
    """Settings of a single-process local run: one quantized model with LoRA adapters, rollout and training."""

    backend: str = _f("auto", "Backend: auto (mlx on Apple silicon, torch elsewhere), mlx or torch.")
    model: str = _f("tiny", "Model: 'tiny', 'tiny-qwen2', 'smollm2-135m', a local HF directory or a hub id.")
    task: str = _f("arithmetic", "Task spec, e.g. 'arithmetic', 'arithmetic:digits=1', 'toy', 'gsm8k:path=FILE'.")
    quant_bits: int = _f(4, "Bits of the frozen base's decoder-block linears: 4, 8, or 16 (no quantization).")
    quant_group_size: int = _f(64, "Quantization group size along the input dimension: 32, 64 or 128.")
    group_size: int = _f(8, "Completions per prompt (G); advantages are relative within a group.")
    prompts_per_step: int = _f(2, "Prompt groups sampled and trained on per optimizer step.")
    max_prompt_tokens: int = _f(256, "Longest prompt accepted (longer training prompts are redrawn).")
    max_tokens: int = _f(64, "Completion length cap (max new tokens).")
    temperature: float = _f(1.0, "Sampling temperature (the loss scores with the same temperature).")
    top_p: float = _f(1.0, "Sampling nucleus mass; 1.0 keeps the importance ratios exact.")
    lora_rank: int = _f(8, "LoRA rank r.")
    lora_alpha: float = _f(16.0, "LoRA alpha; the update is scaled by alpha / r.")
    lora_targets: str = _f("auto", "Adapted linears per decoder block: 'auto' (q/k/v/o and gate/up/down; every "
                                   "linear of a block that has none of them), 'all-linear', or names such as "
                                   "'q_proj,v_proj'.")
    gradient_checkpointing: bool = _f(False, "Recompute each decoder layer's activations in backward (less memory, "
                                             "about one more forward of time).")
    micro_batch: int = _f(0, "Sequences per forward/backward micro-batch (0 = the whole step at once); the loss "
                             "normaliser is the whole batch's, so the gradient does not depend on it.")
    steps: int = _f(20, "Optimizer steps of the run (a resumed run continues up to this total).")
    save_every: int = _f(10, "Save adapters, optimizer state, step and RNG every this many steps (0 = only at "
                             "the end or on interrupt).")
    keep_checkpoints: int = _f(2, "Saved states kept in output_dir/checkpoints (older ones are deleted).")
    output_dir: str = _f("stoa-local", "Directory for metrics.jsonl, checkpoints and the resolved config.")
    resume: bool = _f(True, "Continue from the last saved state in output_dir when there is one (false refuses "
                            "to reuse a directory that holds a run).")
    old_logprobs: str = _f("forward", "Old-policy logprobs: 'forward' (a no-grad full forward before the update, "
                                      "micro-batched like it) or 'reuse' (the training forward's own values, "
                                      "stop-gradient: bitwise the same with one update per batch, one forward "
                                      "cheaper). Never the decode-time logprobs (docs/local.md).")
    lr: float = _f(1e-4, "AdamW learning rate (LoRA adapters only).")
    weight_decay: float = _f(0.0, "AdamW decoupled weight decay.")
    grad_clip: float = _f(1.0, "Clip the adapters' global gradient norm to this (0 disables).")
    algorithm: str = _f("grpo", "RL objective: grpo, dr_grpo, dapo, gspo, rloo, cispo.")
    algo: dict = _f({}, "Algorithm knobs (eps_low, eps_high, dual_clip_c, gate, ...); TOML table [algo].")
    kl_beta: float | None = _f(None, "KL-to-reference weight; 0 skips the reference forward (default: the "
                                     "algorithm's, 0.001 for grpo, 0 for dapo). The reference is the same "
                                     "model with its adapters disabled.")
    seed: int = _f(0, "Seed of LoRA initialisation, prompt order and sampling.")
    eval_every: int = _f(0, "Held-out greedy accuracy every this many steps (0 = only before and after).")
    eval_n: int = _f(64, "Held-out prompts per evaluation (0 disables evaluation).")
    dtype: str = _f("auto", "Compute dtype: auto (MLX: bfloat16 on Metal, float32 on CPU; torch: float32, bf16 "
                            "autocast on CUDA), float32 or bfloat16.")
    device: str = _f("auto", "Torch device: auto, cpu, cuda or cuda:N (torch backend only).")
    threads: int = _f(0, "Torch CPU threads (0 = library default).")
    torch_base: str = _f("auto", "How the torch backend holds the quantized base: 'dequantized' (codes expanded "
                                 "once to float32: fast on CPU, float32 memory), 'packed' (codes resident, "
                                 "dequantized per layer per call: 4-bit memory), auto = packed on CUDA, "
                                 "dequantized on CPU.")
    available_memory_gb: float = _f(0.0, "Memory the run may use, for the preflight check (0 = detect).")
    preflight: bool = _f(True, "Refuse to load the model when the memory estimate exceeds the available memory.")

    def validate(self) -> LocalConfig:
        """Raise ``ConfigError`` naming the first invalid field; return self."""
        _choice(self, "backend", BACKENDS)
        if not self.model:
            raise ConfigError("model", "must not be empty")
        self._check_task()
        if self.quant_bits not in QUANT_BITS:
            raise ConfigError("quant_bits", f"must be 4, 8 or 16 (16 = no quantization), got {self.quant_bits}")
        if self.quant_group_size not in QUANT_GROUP_SIZES:
            raise ConfigError("quant_group_size", f"must be one of {QUANT_GROUP_SIZES}, got {self.quant_group_size}")
        if self.group_size < 2:
            raise ConfigError("group_size", f"group-relative advantages need at least 2 samples, got {self.group_size}")
        for name in ("prompts_per_step", "max_prompt_tokens", "max_tokens", "lora_rank", "steps", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("micro_batch", "save_every", "seed", "eval_every", "eval_n", "threads"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        if not self.temperature > 0:
            raise ConfigError("temperature", f"must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not self.lora_alpha > 0:
            raise ConfigError("lora_alpha", f"must be > 0, got {self.lora_alpha}")
        lora_target_names(self.lora_targets)
        if not self.output_dir:
            raise ConfigError("output_dir", "must not be empty")
        if not 0 < self.lr < 1:
            raise ConfigError("lr", f"must be in (0, 1), got {self.lr}")
        for name in ("weight_decay", "grad_clip", "available_memory_gb"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        if self.kl_beta is not None and self.kl_beta < 0:
            raise ConfigError("kl_beta", f"must be >= 0, got {self.kl_beta}")
        _choice(self, "dtype", DTYPES)
        _choice(self, "torch_base", TORCH_BASE)
        _choice(self, "old_logprobs", OLD_LOGPROBS)
        if not (self.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", self.device)):
            raise ConfigError("device", f"{self.device!r}: use auto, cpu, cuda or cuda:N")
        if resolve_backend(self.backend) == "mlx" and self.device not in ("auto", "cpu"):
            raise ConfigError("device", "the MLX backend picks its own device; device applies to torch only")
        self.algo_config()
        return self

    def _check_task(self) -> None:
        from stoa.tasks import parse_task_spec

        try:
            parse_task_spec(self.task)
        except ValueError as e:
            raise ConfigError("task", str(e)) from None

    def algo_config(self) -> Any:
        """The validated ``AlgoConfig``: the algorithm's preset, the [algo] knobs, kl_beta, temperature, max_tokens."""
        from stoa.algorithms import AlgoConfig

        knobs = dict(self.algo)
        for key in ("temperature", "max_tokens"):
            if key in knobs:
                raise ConfigError(f"algo.{key}", f"set by the top-level '{key}' field; remove it from [algo]")
        if self.kl_beta is not None:
            if "kl_beta" in knobs:
                raise ConfigError("kl_beta", "given both as kl_beta and in [algo]; keep one")
            knobs["kl_beta"] = self.kl_beta
        knobs.update(temperature=self.temperature, max_tokens=self.max_tokens)
        try:
            return AlgoConfig.from_dict({"name": self.algorithm, **knobs})
        except ValueError as e:
            head = str(e).split(":", 1)[0]
            raise ConfigError("algorithm" if head == "name" else f"algo.{head}", str(e)) from None

    def identity(self) -> dict[str, Any]:
        """The fields a resumed run must match (``IDENTITY_FIELDS``), with the backend resolved."""
        out = {k: getattr(self, k) for k in IDENTITY_FIELDS}
        out["backend"] = resolve_backend(self.backend)
        return out


def _choice(cfg: LocalConfig, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        raise ConfigError(name, f"{value!r} is not one of {', '.join(choices)}")


def lora_target_names(spec: str) -> tuple[str, ...]:
    """Parse ``lora_targets``: ('auto',), ('all-linear',) or the listed module names.

    Args:
        spec: 'auto', 'all-linear' or comma-separated names (the last path component, or a path inside the
            block such as 'self_attn.q_proj').
    """
    spec = spec.strip()
    if spec in ("auto", "all-linear"):
        return (spec,)
    names = tuple(s.strip() for s in spec.split(",") if s.strip())
    if not names:
        raise ConfigError("lora_targets", "must be 'auto', 'all-linear' or module names such as 'q_proj,v_proj'")
    for n in names:
        if not _NAME.fullmatch(n):
            raise ConfigError("lora_targets", f"{n!r} is not a module name")
    return names


def is_apple_silicon() -> bool:
    """True on macOS on arm64 (where MLX runs on Metal)."""
    return sys.platform == "darwin" and platform.machine() == "arm64"


def resolve_backend(backend: str) -> str:
    """Map 'auto' to 'mlx' on Apple silicon and 'torch' elsewhere.

    Args:
        backend: 'auto', 'mlx' or 'torch'.
    """
    if backend == "auto":
        return "mlx" if is_apple_silicon() else "torch"
    return backend


def load_local_config(toml_path: str | None = None, overrides: Mapping[str, Any] | None = None) -> LocalConfig:
    """Defaults, then a TOML file, then overrides (CLI flags); validated before anything loads.

    Args:
        toml_path: optional TOML file (flat keys plus an optional [algo] table; ``lora_targets`` may be a
            list). Unknown keys are refused, naming them and the file.
        overrides: field -> value (``None`` values are ignored).
    """
    names = {f.name for f in dataclasses.fields(LocalConfig)}
    values = read_toml_settings(toml_path, names)
    if isinstance(values.get("lora_targets"), list):
        values["lora_targets"] = ",".join(str(x) for x in values["lora_targets"])
    for k, v in (overrides or {}).items():
        if v is not None:
            values[k] = v
    return load_config(LocalConfig, overrides=values, env={})
