"""Typed, frozen configuration for the trainer and workers, read from TOML, env and CLI flags.

Precedence (lowest to highest): dataclass defaults, TOML file, environment (``DRL_*``), CLI flags.
Every field carries its help text in ``metadata["help"]``; CLI flags are generated from the fields.
This module imports neither torch nor mlx.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ENV_VARS = {"run": "DRL_RUN", "n_samples": "DRL_N_SAMPLES", "plane": "DRL_PULSE_PLANE"}
"""Environment names kept for operators used to the original tool."""

PLANES = ("bf16", "int8g64")
ENGINES = ("auto", "torch", "mlx")
WORKER_DTYPES = ("auto", "float32", "bfloat16")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field.

    Args:
        field_name: the offending field.
        message: what is wrong with it.
    """

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def _check_run_id(run: str) -> None:
    if not run or len(run) > 100 or not all(c.isalnum() or c in "-_." for c in run) or run[0] == ".":
        raise ConfigError("run", f"{run!r} must be 1-100 characters of letters, digits, '-', '_' or '.'")


@dataclass(frozen=True)
class TrainerConfig:
    """Trainer settings. Everything a worker must agree on ends up in the run contract."""

    bucket: str = _f("./stoa-runs", "Bucket URL: a local directory, file://DIR or s3://BUCKET/PREFIX.")
    run: str = _f("default", "Run id (env DRL_RUN); names runs/<run>/ in the bucket.")
    model: str = _f("tiny", "Model: 'tiny', 'smollm2-135m', a local HF directory or a hub id.")
    task: str = _f("arithmetic", "Task spec, e.g. 'arithmetic', 'arithmetic:digits=3', 'gsm8k:path=FILE'.")
    n_samples: int = _f(8, "Group size n: completions per prompt (env DRL_N_SAMPLES).")
    plane: str = _f("bf16", "Weight plane published to workers: bf16 or int8g64 (env DRL_PULSE_PLANE).")
    groups_per_step: int = _f(8, "Prompt groups per optimizer step (B).")
    staleness_bound: int = _f(3, "Use records with current_version - policy_version <= this.")
    reuse_cap: int = _f(2, "Use each record in at most this many optimizer steps.")
    algorithm: str = _f("grpo", "RL objective: grpo, dr_grpo, dapo, gspo, rloo, cispo.")
    algo: dict = _f({}, "Algorithm knobs (eps_low, eps_high, dual_clip_c, gate, kl_beta, ...); TOML table [algo].")
    kl_beta: float | None = _f(None, "KL-to-reference coefficient; 0 skips the reference forward "
                               "(default: the algorithm's, 0.001 for grpo, 0 for dapo).")
    lr: float = _f(1e-5, "AdamW learning rate.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this (0 disables).")
    micro_batch: int = _f(16, "Sequences per forward/backward micro-batch (gradient accumulation).")
    temperature: float = _f(1.0, "Sampling temperature (workers sample with it, the trainer scores with it).")
    top_p: float = _f(1.0, "Sampling nucleus mass; 1.0 keeps importance ratios exact.")
    max_new_tokens: int = _f(64, "Completion length cap.")
    steps: int = _f(0, "Stop after this many optimizer steps in this process (0 = run forever).")
    anchor_every: int = _f(16, "Publish a full anchor every this many versions (patches in between).")
    keep_versions: int = _f(8, "Keep weights objects for at least this many recent versions.")
    checkpoint_every: int = _f(1, "Save master weights and optimizer state every this many steps.")
    eval_every: int = _f(0, "Evaluate held-out accuracy every this many steps (0 = only at start/end).")
    eval_n: int = _f(64, "Held-out prompts per evaluation (greedy).")
    log_dir: str = _f("", "Directory for metrics JSONL (default: inside a local bucket, else ./stoa-logs/<run>).")
    seed: int = _f(0, "Random seed.")
    device: str = _f("auto", "Torch device: auto, cpu, cuda, cuda:N.")
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory.")
    shared_prefix: bool = _f(False, "Run each group's prompt once in forward/backward (fewer FLOPs, ~30% less "
                                    "memory, but one group per micro-batch); off packs whole sequences.")
    poll_seconds: float = _f(0.5, "Sleep between bucket listings while waiting for records.")
    max_wait_seconds: float = _f(0.0, "Exit with an error if no usable record arrives for this long (0 = wait forever).")
    quarantine: bool = _f(True, "Skip the records of a worker whose rejection rate or logprob disagreement "
                                "(at lag 0) is over threshold; false turns quarantine off.")
    quarantine_disagreement: float = _f(0.05, "Quarantine a worker whose median exp|recorded - recomputed "
                                              "logprob| - 1 over its lag-0 tokens exceeds this.")
    quarantine_reject_rate: float = _f(0.5, "Quarantine a worker once more than this fraction of its records "
                                            "is rejected.")
    quarantine_min_records: int = _f(8, "Records a worker must have sent before its rates are judged.")

    def validate(self) -> TrainerConfig:
        """Raise ``ConfigError`` naming the first invalid field; return self."""
        _check_run_id(self.run)
        if self.plane not in PLANES:
            raise ConfigError("plane", f"{self.plane!r} is not one of {PLANES}")
        for name in ("n_samples", "groups_per_step", "micro_batch", "max_new_tokens", "anchor_every",
                     "checkpoint_every", "keep_versions"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.n_samples < 2:
            raise ConfigError("n_samples", "group-relative advantages need at least 2 samples per group")
        for name in ("staleness_bound", "steps", "eval_every", "eval_n", "seed"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        if self.reuse_cap < 1:
            raise ConfigError("reuse_cap", "must be >= 1")
        if not (0 < self.lr < 1):
            raise ConfigError("lr", f"must be in (0, 1), got {self.lr}")
        if self.kl_beta is not None and self.kl_beta < 0:
            raise ConfigError("kl_beta", "must be >= 0")
        if self.temperature <= 0:
            raise ConfigError("temperature", "must be > 0")
        if not (0 < self.top_p <= 1):
            raise ConfigError("top_p", "must be in (0, 1]")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError("weight_decay" if self.weight_decay < 0 else "grad_clip", "must be >= 0")
        if self.quarantine_disagreement <= 0:
            raise ConfigError("quarantine_disagreement", "must be > 0 (turn quarantine off with quarantine = false)")
        if not (0 < self.quarantine_reject_rate <= 1):
            raise ConfigError("quarantine_reject_rate", "must be in (0, 1]")
        if self.quarantine_min_records < 1:
            raise ConfigError("quarantine_min_records", "must be >= 1")
        if self.keep_versions < self.staleness_bound + 1:
            raise ConfigError("keep_versions", f"must be >= staleness_bound + 1 = {self.staleness_bound + 1}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError("device", f"{self.device!r}: use auto, cpu, cuda or cuda:N")
        self.algo_config()  # validates algorithm name and knobs
        return self

    def algo_config(self):
        """Return the validated ``AlgoConfig`` for this run (algorithm name + knobs)."""
        from stoa.algorithms.base import AlgoConfig

        knobs = dict(self.algo)
        if self.kl_beta is not None:
            knobs.setdefault("kl_beta", self.kl_beta)
        knobs.setdefault("temperature", self.temperature)
        knobs.setdefault("max_tokens", self.max_new_tokens)
        try:
            cfg = AlgoConfig.from_dict({"name": self.algorithm, **knobs})
            cfg.validate()
        except ValueError as e:
            raise ConfigError("algorithm" if "name" in str(e).split(":")[0] else "algo", str(e)) from e
        return cfg


@dataclass(frozen=True)
class WorkerConfig:
    """Rollout worker settings. Sampling and group size come from the run contract."""

    bucket: str = _f("./stoa-runs", "Bucket URL: a local directory, file://DIR or s3://BUCKET/PREFIX.")
    run: str = _f("default", "Run id (env DRL_RUN).")
    name: str = _f("", "Worker label used in record keys (default: host name); a random suffix is added.")
    engine: str = _f("auto", "Generation engine: auto (mlx on Apple silicon, else torch), torch, mlx.")
    model: str = _f("", "Optional local model dir; checked against the contract (default: from the bucket).")
    plane: str = _f("", "Weight plane this worker expects (env DRL_PULSE_PLANE; empty = the contract's).")
    n_samples: int = _f(0, "Group size this worker expects (env DRL_N_SAMPLES; 0 = the contract's).")
    groups_in_flight: int = _f(0, "Prompt groups decoded together (batch = this x n); 0 = from the memory "
                                  "tier (see --print-tier; env STOA_GROUPS_IN_FLIGHT).")
    max_groups: int = _f(0, "Exit after uploading this many groups (0 = run forever).")
    poll_seconds: float = _f(2.0, "Wait between pointer polls while the run has no weights yet.")
    wait_seconds: float = _f(600.0, "Give up if the run contract or weights do not appear within this long.")
    device: str = _f("auto", "Torch device for the torch engine: auto, cpu, cuda, cuda:N.")
    threads: int = _f(0, "Torch CPU threads (0 = library default).")
    dtype: str = _f("auto", "Compute dtype: auto (torch: bf16 on CUDA and on CPUs with native bf16 when the "
                            "plane is bf16, else fp32; mlx: bf16 on Metal, else fp32), float32, bfloat16.")
    seed: int = _f(-1, "Sampling seed (-1 = random per process).")
    log_dir: str = _f("", "Directory for worker metrics JSONL (default: inside a local bucket, else ./stoa-logs).")
    bucket_retry_seconds: float = _f(300.0, "Retry budget of one bucket request (jittered exponential backoff) "
                                            "before it counts as an outage; overrides STOA_BUCKET_RETRY_TIMEOUT_S.")
    exit_on_outage: bool = _f(False, "Exit (code 4) when a bucket request exhausts its retry budget; by default "
                                     "the worker waits and retries until the bucket answers again.")

    def validate(self) -> WorkerConfig:
        """Raise ``ConfigError`` naming the first invalid field; return self."""
        _check_run_id(self.run)
        if self.plane and self.plane not in PLANES:
            raise ConfigError("plane", f"{self.plane!r} is not one of {PLANES}")
        if self.n_samples < 0:
            raise ConfigError("n_samples", "must be >= 0")
        if self.engine not in ENGINES:
            raise ConfigError("engine", f"{self.engine!r} is not one of {ENGINES}")
        if self.groups_in_flight < 0:
            raise ConfigError("groups_in_flight", "must be >= 0")
        if self.max_groups < 0:
            raise ConfigError("max_groups", "must be >= 0")
        if self.poll_seconds <= 0 or self.wait_seconds <= 0:
            raise ConfigError("poll_seconds" if self.poll_seconds <= 0 else "wait_seconds", "must be > 0")
        if self.name and not all(c.isalnum() or c in "-_." for c in self.name):
            raise ConfigError("name", f"{self.name!r}: use letters, digits, '-', '_' or '.'")
        if self.threads < 0:
            raise ConfigError("threads", "must be >= 0")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError("device", f"{self.device!r}: use auto, cpu, cuda or cuda:N")
        if self.dtype not in WORKER_DTYPES:
            raise ConfigError("dtype", f"{self.dtype!r} is not one of {WORKER_DTYPES}")
        if not self.bucket_retry_seconds > 0:
            raise ConfigError("bucket_retry_seconds", "must be > 0 (seconds one bucket request may retry)")
        return self


C = TypeVar("C")


def _field_type(cls: type, f: dataclasses.Field) -> type:
    hints = typing.get_type_hints(cls)
    t = hints[f.name]
    if isinstance(t, types.UnionType):
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return typing.get_origin(t) or t


def _coerce(cls: type, name: str, value: Any) -> Any:
    f = {x.name: x for x in dataclasses.fields(cls)}[name]
    t = _field_type(cls, f)
    try:
        if t is bool:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if t is dict:
            if not isinstance(value, dict):
                raise ValueError(value)
            return dict(value)
        if t is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return t(value)
    except (TypeError, ValueError):
        raise ConfigError(name, f"expected {t.__name__}, got {value!r}") from None


def read_toml_settings(toml_path: str | Path | None, names: set[str]) -> dict[str, Any]:
    """The top-level settings of a TOML file, keys with ``-`` read as ``_``; unknown keys are refused.

    Args:
        toml_path: the file (None or empty: no settings).
        names: the settings the config class has.

    Raises:
        ConfigError: the file is missing, not TOML, or holds a key not in ``names`` (naming it).
    """
    if not toml_path:
        return {}
    p = Path(toml_path)
    if not p.is_file():
        raise ConfigError("config", f"file not found: {toml_path}")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("config", f"{toml_path} is not valid TOML: {e}") from None
    values: dict[str, Any] = {}
    for k, v in data.items():
        key = k.replace("-", "_")
        if key not in names:
            raise ConfigError(k, f"unknown setting in {toml_path}")
        values[key] = v
    return values


def load_config(
    cls: type[C],
    *,
    toml_path: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> C:
    """Build a config from defaults, a TOML file, ``DRL_*`` env vars and overrides, then validate.

    Args:
        cls: ``TrainerConfig`` or ``WorkerConfig``.
        toml_path: optional TOML file; unknown keys are refused, naming them.
        overrides: values from CLI flags (``None`` values are ignored).
        env: environment mapping (default ``os.environ``).
    """
    env = os.environ if env is None else env
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {k: _coerce(cls, k, v) for k, v in read_toml_settings(toml_path, names).items()}
    for key, var in ENV_VARS.items():
        if key in names and env.get(var):
            values[key] = _coerce(cls, key, env[var])
    for k, v in (overrides or {}).items():
        if v is None:
            continue
        if k not in names:
            raise ConfigError(k, "unknown setting")
        values[k] = _coerce(cls, k, v)
    cfg = cls(**values)
    return cfg.validate()  # type: ignore[attr-defined]


def add_config_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per config field (default ``None`` so unset flags don't override TOML/env).

    Args:
        parser: the argparse parser to extend.
        cls: the config dataclass.
        skip: field names to leave out.
    """
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        t = _field_type(cls, f)
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata.get('help', '')} [default: {f.default!r}]" if f.default is not dataclasses.MISSING else f.metadata.get("help", "")
        if t is dict:
            parser.add_argument(flag, dest=f.name, action="append", metavar="KEY=VALUE", default=None,
                                help=help_text.replace("TOML table", "repeatable; TOML table"))
        elif t is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=str, default=None, metavar=f.name.upper(), help=help_text)


def overrides_from_args(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """Collect the config fields set on the command line.

    Args:
        args: parsed arguments.
        cls: the config dataclass whose fields to collect.
    """
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        v = getattr(args, f.name, None)
        if v is None:
            continue
        if _field_type(cls, f) is dict:
            d: dict[str, Any] = {}
            for item in v:
                if "=" not in item:
                    raise ConfigError(f.name, f"expected KEY=VALUE, got {item!r}")
                k, val = item.split("=", 1)
                d[k.strip()] = _parse_scalar(val.strip())
            v = d
        out[f.name] = v
    return out


def _parse_scalar(s: str) -> Any:
    low = s.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(s)
        except ValueError:
            pass
    return s


def config_to_toml(cfg: Any) -> str:
    """Render a resolved config as TOML text (for ``--dry-run``).

    Args:
        cfg: a config dataclass instance.
    """
    lines, tables = [], []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if v is None:
            lines.append(f"# {f.name} = (unset: {f.metadata.get('help', '')})")
            continue
        if isinstance(v, dict):
            tables.append((f.name, v))
            continue
        lines.append(f"{f.name} = {_toml_value(v)}")
    for name, d in tables:
        lines.append(f"\n[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in sorted(d.items())]
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if v is None:
        return '"none"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
