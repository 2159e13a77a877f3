"""Fixtures for the MLX engine tests: the tiny model directory and its float32 weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random llama (``resolve_model('tiny')``) built in a temporary cache."""
    from stoa.models import resolve_model

    return Path(resolve_model("tiny", cache_dir=tmp_path_factory.mktemp("stoa-cache")))


@pytest.fixture(scope="session")
def tiny_weights(tiny_dir: Path) -> dict[str, np.ndarray]:
    """The tiny model's float32 weights in torch/HF naming, as a trainer would hold them."""
    from safetensors.numpy import load_file

    return {k: v.astype(np.float32) for k, v in load_file(str(tiny_dir / "model.safetensors")).items()}


@pytest.fixture(scope="session")
def mlx_engine(tiny_dir: Path):
    """One fp32 MLX engine on the tiny model (tests that reload weights build their own)."""
    pytest.importorskip("mlx.core", reason="needs mlx (mlx[cpu] on Linux)")
    from stoa.worker.engine_mlx import MLXEngine

    return MLXEngine(tiny_dir, dtype="float32")


@pytest.fixture(scope="session")
def torch_engine(tiny_dir: Path):
    """The torch engine on the same directory (CPU, float32)."""
    pytest.importorskip("torch", reason="the comparison needs torch")
    from stoa.worker.engine_torch import TorchEngine

    return TorchEngine(tiny_dir, device="cpu")
