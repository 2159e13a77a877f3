"""``LocalConfig``: single-process local mode, a learner (``TrainingConfig``) with a quantized base and LoRA.

Local mode used to name four settings differently from the fleet; the old names are deprecated aliases
(``ALIASES``): accepted in TOML and as flags with a warning, readable as properties and accepted as
keywords by the constructor until every caller uses the new names.
"""

from __future__ import annotations

import functools
import platform
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from stoa.config.base import BACKENDS, DTYPES, OLD_LOGPROBS, TORCH_BASE, ConfigError, at_least, one_of, setting
from stoa.config.loading import load_config
from stoa.config.training import TrainingConfig

QUANT_BITS = (4, 8, 16)
QUANT_GROUP_SIZES = (32, 64, 128)
DENSE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""What ``lora_targets = "auto"`` adapts in a dense decoder block (attention and MLP projections)."""

IDENTITY_FIELDS = ("backend", "model", "quant_bits", "quant_group_size", "lora_rank", "lora_alpha",
                   "lora_targets")
"""Fields a resumed run must share with the run that wrote the checkpoint (they shape the adapters)."""

OLD_NAMES = {"group_size": "n_samples", "prompts_per_step": "groups_per_step", "max_tokens": "max_new_tokens",
             "save_every": "checkpoint_every"}
"""Local mode's former names -> the names shared with the fleet."""

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_T = TypeVar("_T", bound=type)


def _accept_old_keywords(cls: _T) -> _T:
    """Let ``cls(group_size=4)`` and ``dataclasses.replace(cfg, group_size=4)`` set the renamed field.

    ``replace`` passes every field plus the change, so an old keyword wins over the new name's copy.
    """
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        for old, new in OLD_NAMES.items():
            if old in kwargs:
                kwargs[new] = kwargs.pop(old)
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


@_accept_old_keywords
@dataclass(frozen=True)
class LocalConfig(TrainingConfig):
    """A single-process local run: one quantized model with LoRA adapters, rollout and training."""

    SECTION: ClassVar[str] = "local"
    ALIASES: ClassVar[Mapping[str, str]] = OLD_NAMES

    model: str = setting("tiny", "Model: a built-in name ('tiny', 'tiny-qwen3', 'tiny-lfm2-moe', 'smollm2-135m', ...; "
                                 "see stoa model pull --help), a local HF directory or a hub id.")
    seed: int = setting(0, "Seed of LoRA initialisation, prompt order and sampling.")
    groups_per_step: int = setting(2, "Prompt groups sampled and trained on per optimizer step.")
    kl_beta: float | None = setting(None, "KL-to-reference weight; 0 skips the reference forward (default: "
                                          "the algorithm's, 0.001 for grpo, 0 for dapo). The reference is "
                                          "the same model with its adapters disabled.")
    lr: float = setting(1e-4, "AdamW learning rate (LoRA adapters only).")
    micro_batch: int = setting(0, "Sequences per forward/backward micro-batch (0 = the whole step at once); "
                                  "the loss normaliser is the whole batch's, so the gradient does not depend "
                                  "on it.")
    gradient_checkpointing: bool = setting(False, "Recompute each decoder layer's activations in backward "
                                                  "(less memory, about one more forward of time).")
    steps: int = setting(20, "Optimizer steps of the run (a resumed run continues up to this total).")
    checkpoint_every: int = setting(10, "Save adapters, optimizer state, step and RNG every this many steps "
                                        "(0 = only at the end or on interrupt).")
    eval_n: int = setting(64, "Held-out prompts per evaluation (0 disables evaluation).")
    eval_k: int = setting(1, "Multi-turn tasks: sampled episodes per held-out prompt for eval/pass@k (1 = greedy "
                             "EM and cover-EM only).")
    backend: str = setting("auto", "Backend: auto (mlx on Apple silicon, torch elsewhere), mlx or torch.")
    quant_bits: int = setting(4, "Bits of the frozen base's decoder-block linears: 4, 8, or 16 (no "
                                 "quantization).")
    quant_group_size: int = setting(64, "Quantization group size along the input dimension: 32, 64 or 128.")
    max_prompt_tokens: int = setting(256, "Longest prompt accepted (longer training prompts are redrawn).")
    lora_rank: int = setting(8, "LoRA rank r.")
    lora_alpha: float = setting(16.0, "LoRA alpha; the update is scaled by alpha / r.")
    lora_targets: str = setting("auto", "Adapted linears per decoder block: 'auto' (attention, dense and "
                                        "shared-expert MLP, conv and linear-attention projections; never "
                                        "routers or experts: docs/local.md), "
                                        "'all-linear', or names such as 'q_proj,v_proj' (a TOML list also "
                                        "works).", join=",")
    keep_checkpoints: int = setting(2, "Saved states kept in output_dir/checkpoints (older ones are "
                                       "deleted).")
    output_dir: str = setting("stoa-local", "Directory for metrics.jsonl, checkpoints and the resolved "
                                            "config.")
    resume: bool = setting(True, "Continue from the last saved state in output_dir when there is one (false "
                                 "refuses to reuse a directory that holds a run).")
    old_logprobs: str = setting("forward", "Old-policy logprobs: 'forward' (a no-grad full forward before "
                                           "the update, micro-batched like it) or 'reuse' (the training "
                                           "forward's own values, stop-gradient: bitwise the same with one "
                                           "update per batch, one forward cheaper). Never the decode-time "
                                           "logprobs (docs/local.md).")
    dtype: str = setting("auto", "Compute dtype: auto (MLX: bfloat16 on Metal, float32 on CPU; torch: "
                                 "float32, bf16 autocast on CUDA), float32 or bfloat16.")
    threads: int = setting(0, "Torch CPU threads (0 = library default).")
    torch_base: str = setting("auto", "How the torch backend holds the quantized base: 'dequantized' (codes "
                                      "expanded once to float32: fast on CPU, float32 memory), 'packed' "
                                      "(codes resident, dequantized per layer per call: 4-bit memory), auto "
                                      "= packed on CUDA, dequantized on CPU.")
    available_memory_gb: float = setting(0.0, "Memory the run may use, for the preflight check (0 = detect).")
    preflight: bool = setting(True, "Refuse to load the model when the memory estimate exceeds the available "
                                    "memory.")
    cold_start: str = setting("", "Begin a new run with supervised fine-tuning of the adapters before the first RL "
                                  "step (loss on the policy's own turns only): '' (none), 'demos' "
                                  "(demonstrations the task builds; search and arithmetic have them) or the path "
                                  "of a JSONL file of conversations ({\"messages\": [...]}, TRL's conversational "
                                  "format). Runs once per output_dir; a resumed run never redoes it.")
    cold_start_steps: int = setting(32, "AdamW steps of the cold start (with cold_start set).")
    cold_start_examples: int = setting(256, "Demonstrations the cold start trains on: built by the task, or the "
                                            "first this many of the JSONL file.")
    cold_start_batch: int = setting(8, "Demonstrations per cold-start step (micro-batched by micro_batch).")
    cold_start_lr: float = setting(1e-4, "AdamW learning rate of the cold start (its own optimizer; RL starts "
                                         "with fresh moments at lr); 0 = use lr.")

    def validate(self) -> LocalConfig:
        """Raise ``ConfigError`` naming the first invalid field; return self."""
        one_of(self, "backend", BACKENDS)
        if not self.model:
            raise ConfigError("model", "must not be empty")
        if self.quant_bits not in QUANT_BITS:
            raise ConfigError("quant_bits", f"must be 4, 8 or 16 (16 = no quantization), got "
                                            f"{self.quant_bits}")
        one_of(self, "quant_group_size", QUANT_GROUP_SIZES)
        super().validate()
        at_least(self, 1, ("max_prompt_tokens", "lora_rank", "steps", "keep_checkpoints", "eval_k"))
        at_least(self, 0, ("threads", "available_memory_gb"))
        if not self.lora_alpha > 0:
            raise ConfigError("lora_alpha", f"must be > 0, got {self.lora_alpha}")
        lora_target_names(self.lora_targets)
        if not self.output_dir:
            raise ConfigError("output_dir", "must not be empty")
        for name, choices in (("dtype", DTYPES), ("torch_base", TORCH_BASE), ("old_logprobs", OLD_LOGPROBS)):
            one_of(self, name, choices)
        if resolve_backend(self.backend) == "mlx" and self.device not in ("auto", "cpu"):
            raise ConfigError("device", "the MLX backend picks its own device; device applies to torch only")
        self._check_cold_start()
        return self

    def _check_cold_start(self) -> None:
        """Raise ``ConfigError`` for cold-start settings that cannot run (as the trainer's)."""
        at_least(self, 1, ("cold_start_steps", "cold_start_examples", "cold_start_batch"))
        if not 0 <= self.cold_start_lr < 1:
            raise ConfigError("cold_start_lr", f"must be in [0, 1) (0 = use lr), got {self.cold_start_lr}")
        if self.cold_start not in ("", "demos") and not self.cold_start.endswith((".jsonl", ".json")):
            raise ConfigError("cold_start", f"{self.cold_start!r} is not '', 'demos' or a .jsonl file of "
                                            "conversations; give one of those")

    def identity(self) -> dict[str, Any]:
        """The fields a resumed run must match (``IDENTITY_FIELDS``), with the backend resolved."""
        out = {k: getattr(self, k) for k in IDENTITY_FIELDS}
        out["backend"] = resolve_backend(self.backend)
        return out

    # Deprecated names, readable until the callers are renamed (see OLD_NAMES).
    @property
    def group_size(self) -> int:
        """Deprecated name of ``n_samples``."""
        return self.n_samples

    @property
    def prompts_per_step(self) -> int:
        """Deprecated name of ``groups_per_step``."""
        return self.groups_per_step

    @property
    def max_tokens(self) -> int:
        """Deprecated name of ``max_new_tokens``."""
        return self.max_new_tokens

    @property
    def save_every(self) -> int:
        """Deprecated name of ``checkpoint_every``."""
        return self.checkpoint_every


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
        raise ConfigError("lora_targets", "must be 'auto', 'all-linear' or module names such as "
                                          "'q_proj,v_proj'")
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


def load_local_config(toml_path: str | None = None,
                      overrides: Mapping[str, Any] | None = None) -> LocalConfig:
    """Defaults, then a TOML file (flat, or its ``[local]`` section), then overrides; validated before
    anything loads. Same as ``load_config(LocalConfig, ...)``; local mode reads no environment variables.

    Args:
        toml_path: optional TOML file (``lora_targets`` may be a list). Unknown keys are refused, naming them.
        overrides: field (or deprecated alias) -> value (``None`` values are ignored).
    """
    return load_config(LocalConfig, toml_path=toml_path, overrides=overrides, env={})
