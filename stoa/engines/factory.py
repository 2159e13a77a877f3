"""An engine by name, or one wrapped around a model already loaded; torch and mlx load only when asked for."""

from __future__ import annotations

import platform
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stoa.engines.base import Engine

ENGINE_NAMES = ("torch", "mlx")


def default_engine() -> str:
    """``mlx`` on Apple silicon, ``torch`` elsewhere."""
    return "mlx" if platform.system() == "Darwin" and platform.machine() == "arm64" else "torch"


def make_engine(name: str, model_dir: str | Path, *, dtype: str = "auto", device: str = "auto",
                threads: int = 0, plane: str = "bf16") -> Engine:
    """Build a generation engine on a model directory.

    Args:
        name: ``torch``, ``mlx`` or ``auto`` (:func:`default_engine`).
        model_dir: HF directory with config.json (weights optional: ``load_state`` fills them).
        dtype: compute dtype: ``auto``, ``float32``, ``bfloat16`` (MLX also ``float16``); see each engine.
        device: torch device (``auto``, ``cpu``, ``cuda``, ``cuda:N``); the torch engine only.
        threads: torch CPU threads (0 keeps torch's default); the torch engine only.
        plane: the run's weight plane, which ``dtype="auto"`` weighs on the torch engine.

    Raises:
        ValueError: on an unknown name or dtype.
    """
    if name == "auto":
        name = default_engine()
    if name == "mlx":
        from stoa.engines.mlx.engine import MLXEngine

        return MLXEngine(model_dir, dtype=dtype)
    if name == "torch":
        from stoa.engines.torch import TorchEngine

        return TorchEngine(model_dir, device=device, threads=threads, dtype=dtype, plane=plane)
    raise ValueError(f"engine {name!r}: use auto, {', '.join(ENGINE_NAMES)}")


def engine_from_model(model: Any, config: Mapping[str, Any] | None = None, dtype: str = "auto") -> Engine:
    """An engine sampling from a model this process already holds (no second copy of the weights).

    A torch module (the trainer's policy) gets the torch engine, in the module's device and dtype (it is
    put in eval mode); an mlx-lm model (local mode's policy) gets the MLX engine.

    Args:
        model: a transformers causal LM or an mlx-lm model.
        config: the model's config.json as a dict (MLX models only).
        dtype: the dtype an MLX model computes in (``auto``: the machine's default); MLX models only.

    Raises:
        TypeError: on anything else.
        ValueError: on an MLX model without its config.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        from stoa.engines.torch import TorchEngine

        return TorchEngine.from_model(model)
    mlx_nn = sys.modules.get("mlx.nn")
    if mlx_nn is not None and isinstance(model, mlx_nn.Module):
        if config is None:
            raise ValueError("an MLX model needs its config: pass engine_from_model(model, config)")
        from stoa.engines.mlx.engine import MLXEngine

        return MLXEngine.from_model(model, config, dtype)
    raise TypeError(f"no engine for a {type(model).__name__}: pass a transformers or mlx-lm model")
