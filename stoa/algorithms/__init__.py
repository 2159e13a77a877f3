"""RL objectives (GRPO family, GiGPO, ECHO) for the torch trainer and MLX local mode; importing loads no backend."""

from stoa.algorithms.base import (
    ALGORITHM_NAMES,
    ECHO_SCHEDULES,
    PRESETS,
    AlgoConfig,
    Algorithm,
    LossInputs,
    echo_coefficient,
)
from stoa.algorithms.diagnostics import combine_metrics
from stoa.algorithms.registry import get_algorithm

__all__ = [
    "ALGORITHM_NAMES",
    "ECHO_SCHEDULES",
    "PRESETS",
    "AlgoConfig",
    "Algorithm",
    "LossInputs",
    "combine_metrics",
    "echo_coefficient",
    "get_algorithm",
]
