"""Algorithm registry: name -> concrete class, imported lazily so callers never import concrete modules."""

from __future__ import annotations

import importlib

from stoa.algorithms.base import ALGORITHM_NAMES, AlgoConfig, Algorithm
from stoa.algorithms.ops import load_ops

_CLASSES: dict[str, str] = {
    "grpo": "stoa.algorithms.grpo:GRPO",
    "dr_grpo": "stoa.algorithms.dr_grpo:DrGRPO",
    "dapo": "stoa.algorithms.dapo:DAPO",
    "gspo": "stoa.algorithms.gspo:GSPO",
    "rloo": "stoa.algorithms.rloo:RLOO",
    "cispo": "stoa.algorithms.cispo:CISPO",
    "gigpo": "stoa.algorithms.gigpo:GiGPO",
}
assert tuple(_CLASSES) == ALGORITHM_NAMES


def get_algorithm(cfg: AlgoConfig, backend: str = "torch") -> Algorithm:
    """The algorithm ``cfg.name`` on a backend.

    Args:
        cfg: a validated config (``AlgoConfig.preset`` / ``AlgoConfig.from_dict``).
        backend: 'torch' (the trainer) or 'mlx' (the local mode).
    """
    cfg.validate()
    ops = load_ops(backend)
    module_name, cls_name = _CLASSES[cfg.name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(cfg, ops)
