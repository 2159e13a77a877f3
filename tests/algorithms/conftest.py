"""Backend runners shared by the algorithm tests."""

from __future__ import annotations

import importlib.util

import pytest

HAS_MLX = importlib.util.find_spec("mlx") is not None

BACKENDS = [
    pytest.param("torch", id="torch"),
    pytest.param("mlx", id="mlx", marks=[pytest.mark.mlx,
                                          pytest.mark.skipif(not HAS_MLX, reason="mlx is not importable")]),
]
