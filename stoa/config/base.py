"""The root of the config hierarchy: ``ConfigError``, the field helper, and the settings every command shares.

``BaseConfig`` holds what every command has (model, group size, seed, device); ``FleetConfig`` adds what
the trainer and its workers share to meet at a bucket (bucket, run, plane, log directory, ``STOA_*`` env;
the former ``DRL_*`` names still work, ``stoa.config.names.ENV_ALIASES``).
Each class names its TOML section (``SECTION``) and registers itself in ``SECTIONS``, so one TOML file can
hold ``[trainer]``, ``[worker]`` and ``[local]`` sections. Stdlib only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

PLANES = ("bf16", "int8g64", "int4g64")
"""Weight planes the trainer can publish (``int4g64``: a LoRA run's base only)."""
DTYPES = ("auto", "float32", "bfloat16")
"""Compute dtypes of a worker engine and of local mode."""
TRACKERS = ("wandb", "tensorboard")
"""Experiment trackers ``report_to`` may name (``stoa.telemetry.trackers``)."""
ENGINES = ("auto", "torch", "mlx")
"""Sampling engines of a worker (``auto``: mlx on Apple silicon, else torch)."""
BACKENDS = ("auto", "mlx", "torch")
"""Backends of local mode (``auto``: mlx where it is installed, else torch)."""
TORCH_BASE = ("auto", "dequantized", "packed")
"""How local mode's torch backend holds a quantized base."""
OLD_LOGPROBS = ("forward", "reuse")
"""Where local mode's old-policy logprobs come from."""

SECTIONS: dict[str, type[BaseConfig]] = {}
"""TOML section name -> the config class that reads it (filled as the classes are defined)."""

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
WORKER_DEVICES = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
"""A worker's torch engine also runs on Apple's GPU (``mps``)."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field.

    Args:
        field_name: the offending field.
        message: what is wrong with it (and how to fix it).
    """

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


def setting(default: Any, help: str, **meta: Any) -> Any:
    """A config field with its help text in ``metadata["help"]`` (the flag's help and the docs).

    Args:
        default: the default value (a dict default is copied per instance).
        help: one or two sentences: what the field does and its unit or choices.
        meta: more metadata, e.g. ``join=","`` to accept a TOML list joined into the string.
    """
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


def at_least(cfg: Any, low: float, names: Iterable[str]) -> None:
    """Raise ``ConfigError`` for the first of ``names`` below ``low``.

    Args:
        cfg: the config.
        low: the smallest allowed value.
        names: field names to check.
    """
    for name in names:
        value = getattr(cfg, name)
        if value < low:
            raise ConfigError(name, f"must be >= {low}, got {value}")


def one_of(cfg: Any, name: str, choices: tuple[Any, ...]) -> None:
    """Raise ``ConfigError`` unless field ``name`` is one of ``choices``.

    Args:
        cfg: the config.
        name: field name.
        choices: the allowed values.
    """
    value = getattr(cfg, name)
    if value not in choices:
        raise ConfigError(name, f"{value!r} is not one of {', '.join(map(str, choices))}")


def report_to_names(value: str) -> list[str]:
    """The tracker names of a ``report_to`` value, in order, without blanks or repeats.

    Args:
        value: a comma-separated list such as ``"wandb,tensorboard"``.
    """
    names: list[str] = []
    for part in value.split(","):
        name = part.strip().lower()
        if name and name not in names:
            names.append(name)
    return names


@dataclass(frozen=True)
class BaseConfig:
    """Settings every command has: the model, the group size, the seed, the torch device."""

    SECTION: ClassVar[str] = ""
    """TOML section of this command (``[trainer]``, ``[worker]``, ``[local]``); empty for abstract bases."""
    ENV_VARS: ClassVar[Mapping[str, str]] = {}
    """Field -> environment variable read between the TOML file and the flags."""
    ALIASES: ClassVar[Mapping[str, str]] = {}
    """Deprecated name -> current field name; accepted in TOML and as flags, with a warning."""
    DEVICES: ClassVar[re.Pattern[str]] = _DEVICE
    """The ``device`` values this command accepts."""

    model: str = setting("tiny", "Model: 'tiny', 'smollm2-135m', a local HF directory or a hub id.")
    n_samples: int = setting(8, "Group size n: completions per prompt; advantages are relative within a "
                                "group.")
    seed: int = setting(0, "Random seed.")
    device: str = setting("auto", "Torch device: auto, cpu, cuda or cuda:N (a worker also takes mps).")
    retriever: str = setting("", "Search tasks' retriever: the URL of a shared endpoint ('stoa retriever serve'), "
                                 "or a local index directory ('stoa retriever index'); empty: the run's index "
                                 "from the bucket (fleet) or one built from the task's corpus.")
    report_to: str = setting("", "Experiment trackers the metrics also go to, comma-separated: wandb, tensorboard "
                                 "(a TOML list also works); empty: only the metrics JSONL.", join=",")

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.__dict__.get("SECTION"):
            SECTIONS[cls.SECTION] = cls

    def validate(self) -> BaseConfig:
        """Raise ``ConfigError`` naming the first invalid field; return self (subclasses extend it)."""
        if self.n_samples < 0:
            raise ConfigError("n_samples", f"must be >= 0, got {self.n_samples}")
        if not self.DEVICES.fullmatch(self.device):
            mps = " or mps" if self.DEVICES.fullmatch("mps") else ""
            raise ConfigError("device", f"{self.device!r}: use auto, cpu, cuda, cuda:N{mps}")
        for name in report_to_names(self.report_to):
            if name not in TRACKERS:
                raise ConfigError("report_to", f"{name!r} is not one of {', '.join(TRACKERS)}")
        return self


@dataclass(frozen=True)
class FleetConfig(BaseConfig):
    """Settings the trainer and its workers share: where they meet (bucket, run) and what travels there."""

    ENV_VARS: ClassVar[Mapping[str, str]] = {"run": "STOA_RUN", "n_samples": "STOA_N_SAMPLES",
                                             "plane": "STOA_PLANE"}

    bucket: str = setting("./stoa-runs", "Bucket URL: a local directory, file://DIR or s3://BUCKET/PREFIX.")
    run: str = setting("default", "Run id; names runs/<run>/ in the bucket.")
    plane: str = setting("bf16", "Weight plane published to workers: bf16 or int8g64; "
                                           "int4g64 for a LoRA run's base only (lora_rank > 0).")
    log_dir: str = setting("", "Directory for metrics JSONL (default: inside a local bucket, else under "
                               "./stoa-logs).")

    def validate(self) -> FleetConfig:
        """Raise ``ConfigError`` naming the first invalid field; return self."""
        super().validate()
        run = self.run
        if not run or len(run) > 100 or not all(c.isalnum() or c in "-_." for c in run) or run[0] == ".":
            raise ConfigError("run", f"{run!r} must be 1-100 characters of letters, digits, '-', '_' or '.'")
        if self.plane and self.plane not in PLANES:
            raise ConfigError("plane", f"{self.plane!r} is not one of {PLANES}")
        return self
