"""Fixtures for the engine tests: the tiny model's float32 weights and one engine of each kind on it.

The ``test_mlx_*`` modules import mlx at the top; without mlx (``mlx[cpu]`` on Linux) they are not collected.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

collect_ignore_glob = [] if importlib.util.find_spec("mlx") else ["test_mlx_*.py"]


@pytest.fixture(scope="session")
def tiny_weights(tiny_dir: Path) -> dict[str, np.ndarray]:
    """The tiny model's float32 weights in torch/HF naming, as a trainer would hold them."""
    from safetensors.numpy import load_file

    return {k: v.astype(np.float32) for k, v in load_file(str(tiny_dir / "model.safetensors")).items()}


@pytest.fixture(scope="session")
def mlx_engine(tiny_dir: Path):
    """One fp32 MLX engine on the tiny model (tests that reload weights build their own)."""
    from stoa.engines.mlx.engine import MLXEngine

    return MLXEngine(tiny_dir, dtype="float32")


@pytest.fixture(scope="session")
def torch_engine(tiny_dir: Path):
    """The torch engine on the same directory (CPU, float32)."""
    from stoa.engines.torch import TorchEngine

    return TorchEngine(tiny_dir, device="cpu")
