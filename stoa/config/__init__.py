"""Typed, frozen configuration for every command: TOML, ``STOA_*`` environment and CLI flags.

One class hierarchy (each a frozen dataclass whose fields carry their help text):

    BaseConfig        model, n_samples, seed, device                        (every command)
    ├─ FleetConfig    + bucket, run, plane, log_dir; STOA_* env              (trainer and workers)
    │  └─ WorkerConfig                                                      (stoa worker, [worker])
    └─ TrainingConfig + task, rollout shape, objective, optimizer; algo_config()   (whatever learns)
       ├─ TrainerConfig (also a FleetConfig)                                (stoa trainer, [trainer])
       └─ LocalConfig   + quantized base, LoRA, output dir                  (stoa local, [local])

Precedence (lowest to highest): dataclass defaults, TOML file, environment (``STOA_*``), CLI flags. One TOML
file may hold ``[trainer]``, ``[worker]`` and ``[local]`` sections over shared top-level keys
(``loading``). Local mode's former names (``group_size``, ``prompts_per_step``, ``max_tokens``,
``save_every``) are deprecated aliases. This package imports neither torch nor mlx.
"""

from __future__ import annotations

from stoa.config.base import DTYPES, ENGINES, PLANES, SECTIONS, BaseConfig, ConfigError, FleetConfig
from stoa.config.loading import DeprecatedSetting, load_config, read_toml
from stoa.config.local import LocalConfig, load_local_config
from stoa.config.text import add_config_flags, config_to_toml, overrides_from_args, parse_scalar
from stoa.config.trainer import TrainerConfig
from stoa.config.training import ALGO_TWINS, TrainingConfig
from stoa.config.worker import WORKER_DTYPES, WorkerConfig

ENV_VARS = dict(FleetConfig.ENV_VARS)
"""Field -> the environment variable that sets it (``STOA_*``; ``names.ENV_ALIASES`` keeps the old names)."""


__all__ = [
    "ALGO_TWINS", "DTYPES", "ENGINES", "ENV_VARS", "PLANES", "SECTIONS", "WORKER_DTYPES", "BaseConfig",
    "ConfigError", "DeprecatedSetting", "FleetConfig", "LocalConfig", "TrainerConfig", "TrainingConfig",
    "WorkerConfig", "add_config_flags", "config_to_toml", "load_config", "load_local_config",
    "overrides_from_args", "parse_scalar", "read_toml",
]
