"""Saved local-run state: adapters (mlx-lm adapter format), AdamW moments, step and RNG; latest pointer written last."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from stoa.config import ConfigError
from stoa.config.local import LocalConfig
from stoa.local.backend import Backend

STATE_VERSION = 1
LATEST = "latest.json"


@dataclass
class SavedState:
    """One saved state read back from disk."""

    path: Path
    step: int
    optimizer_step: int
    rng: dict[str, Any]
    identity: dict[str, Any]
    adapters: dict[str, np.ndarray]
    optimizer: dict[str, np.ndarray]


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def adapter_config(cfg: LocalConfig, backend: Backend) -> dict[str, Any]:
    """``adapter_config.json`` in mlx-lm's format (``mlx_lm.load(..., adapter_path=DIR)`` reads it).

    Args:
        cfg: the run's config.
        backend: the model (for the layer count and the adapted paths).
    """
    keys = sorted({p for layer in backend.summary.targets_per_layer for p in layer})
    return {"fine_tune_type": "lora", "num_layers": backend.summary.layers,
            "lora_parameters": {"rank": cfg.lora_rank, "scale": cfg.lora_alpha / cfg.lora_rank, "dropout": 0.0,
                                "keys": keys},
            "stoa": {"model": cfg.model, "quant_bits": cfg.quant_bits, "quant_group_size": cfg.quant_group_size,
                     "backend": backend.name}}


def write_adapters(directory: Path, cfg: LocalConfig, backend: Backend) -> None:
    """Write ``adapters.safetensors`` and ``adapter_config.json`` into ``directory``.

    Args:
        directory: target directory (created).
        cfg: the run's config.
        backend: the model.
    """
    directory.mkdir(parents=True, exist_ok=True)
    save_file(backend.adapter_arrays(), str(directory / "adapters.safetensors"))
    _write_json(directory / "adapter_config.json", adapter_config(cfg, backend))


def save_state(out_dir: Path, cfg: LocalConfig, backend: Backend, *, step: int, rng: dict[str, Any]) -> Path:
    """Save adapters, optimizer moments, step and RNG under ``checkpoints/step-NNNNNN``; then point latest at it.

    The directory is built under a temporary name and renamed into place, and ``latest.json`` is replaced
    atomically last, so an interrupted save leaves the previous state in force. Older states beyond
    ``cfg.keep_checkpoints`` are deleted afterwards.

    Args:
        out_dir: the run's output directory.
        cfg: the run's config.
        backend: the model and optimizer.
        step: optimizer steps taken.
        rng: the prompt sampler's ``bit_generator.state``.
    """
    root = out_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    write_adapters(tmp, cfg, backend)
    moments, opt_step = backend.optimizer_arrays()
    save_file(moments, str(tmp / "optimizer.safetensors"))
    _write_json(tmp / "state.json", {"version": STATE_VERSION, "step": step, "optimizer_step": opt_step,
                                     "rng": rng, "identity": cfg.identity()})
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _write_json(out_dir / LATEST, {"step": step, "dir": f"checkpoints/{final.name}"})
    for old in sorted(root.glob("step-*"))[: -cfg.keep_checkpoints]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def find_latest(out_dir: Path) -> SavedState | None:
    """The state ``latest.json`` points at, or None when the directory holds no saved run.

    Args:
        out_dir: the run's output directory.

    Raises:
        ValueError: when the pointer or the state it names is unreadable.
    """
    pointer = out_dir / LATEST
    if not pointer.is_file():
        return None
    try:
        where = out_dir / json.loads(pointer.read_text())["dir"]
        meta = json.loads((where / "state.json").read_text())
        if meta.get("version") != STATE_VERSION:
            raise ValueError(f"state version {meta.get('version')} (this code reads {STATE_VERSION})")
        return SavedState(where, int(meta["step"]), int(meta["optimizer_step"]), meta["rng"], meta["identity"],
                          load_file(str(where / "adapters.safetensors")),
                          load_file(str(where / "optimizer.safetensors")))
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"cannot read the saved state in {out_dir}: {e}") from e


def check_resumable(cfg: LocalConfig, saved: SavedState | None) -> None:
    """Refuse to reuse an output directory whose saved run the config cannot continue.

    Args:
        cfg: the new run's config.
        saved: what ``find_latest`` returned.

    Raises:
        ConfigError: naming ``resume`` (resume disabled) or the first differing identity field.
    """
    if saved is None:
        return
    if not cfg.resume:
        raise ConfigError("resume", f"{cfg.output_dir} holds a run saved at step {saved.step}; resume it "
                                    "(resume = true) or choose another output_dir")
    mine = cfg.identity()
    for k, v in mine.items():
        if saved.identity.get(k) != v:
            raise ConfigError(k, f"{cfg.output_dir} holds a run with {k} = {saved.identity.get(k)!r}, this config "
                                 f"has {v!r}; use another output_dir")


def restore(saved: SavedState, backend: Backend) -> None:
    """Load adapters and optimizer moments of a saved state into the backend.

    Args:
        saved: the state.
        backend: the freshly built model.
    """
    backend.load_adapter_arrays(saved.adapters)
    backend.load_optimizer_arrays(saved.optimizer, saved.optimizer_step)
