"""RL objectives (GRPO family) for the torch trainer and the MLX local mode; importing this loads no backend."""

from stoa.algorithms.base import (
    ALGORITHM_NAMES,
    PRESETS,
    AlgoConfig,
    Algorithm,
    LossInputs,
    combine_metrics,
)
from stoa.algorithms.registry import get_algorithm

__all__ = [
    "ALGORITHM_NAMES",
    "PRESETS",
    "AlgoConfig",
    "Algorithm",
    "LossInputs",
    "combine_metrics",
    "get_algorithm",
]
