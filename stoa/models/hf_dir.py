"""A Hugging Face model directory written from tensors: what ``stoa export`` and local mode's export share.

``model.safetensors`` plus the config and tokenizer files of the model it was trained from; the names are the
family's checkpoint names, so transformers and mlx-lm open it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

WEIGHTS_FILE = "model.safetensors"
"""The one weights file of an exported directory."""


class ExportError(Exception):
    """A user error of an export: one line naming the problem and the fix."""


def check_out_dir(out: Path) -> None:
    """Refuse an output path that is a file or a non-empty directory (nothing is ever overwritten).

    Args:
        out: the export directory.
    """
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file; give a new directory as OUT")
    if out.is_dir() and any(out.iterdir()):
        raise ExportError(f"{out} is not empty; give a new directory as OUT (or empty this one)")


def write_model_files(out: Path, model_dir: Path, dtype: str) -> None:
    """Copy the config and tokenizer files of ``model_dir`` into ``out`` (created), no weights.

    ``config.json`` gets ``torch_dtype`` set to ``dtype`` so both loaders pick the dtype that was written.

    Args:
        out: the target directory.
        model_dir: a directory holding ``config.json`` and tokenizer files.
        dtype: ``bfloat16`` or ``float32``.
    """
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(model_dir).iterdir()):
        if (f.is_file() and not f.name.endswith((".safetensors", ".bin", ".gguf", ".safetensors.index.json"))
                and f.name != "config.json"):
            (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config["torch_dtype"] = dtype
    if "dtype" in config:
        config["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_hf_dir(out: Path, tensors: Mapping[str, Any], model_dir: Path, dtype: str) -> int:
    """Write ``model.safetensors`` plus the config and tokenizer files of ``model_dir`` into ``out``.

    Args:
        out: the target directory (created; must be empty).
        tensors: name -> torch tensor (already in ``dtype``).
        model_dir: a directory holding ``config.json`` and tokenizer files (no weights are copied).
        dtype: ``bfloat16`` or ``float32``.

    Returns:
        the size of ``model.safetensors`` in bytes.
    """
    from safetensors.torch import save_file

    write_model_files(out, model_dir, dtype)
    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    save_file(contiguous, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return os.path.getsize(out / WEIGHTS_FILE)


def meta_model(model_dir: Path) -> Any:
    """The transformers model of ``model_dir``'s config on the meta device (names and conversions, no memory).

    Args:
        model_dir: a directory holding ``config.json``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def checkpoint_names(tensors: dict[str, Any], model: Any) -> dict[str, Any]:
    """Tensors under the names of the family's Hugging Face checkpoints (transformers reverses the conversions
    it applies on load, e.g. fused MoE experts split per expert); unchanged where transformers has none.

    Args:
        tensors: the model's names -> torch tensors.
        model: the model (a meta one is enough).
    """
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4 converts nothing on load: its names are the checkpoint's
        return dict(tensors)
    return dict(revert_weight_conversion(model, dict(tensors)))


def missing_buffers(tensors: dict[str, Any], model: Any) -> list[str]:
    """The persistent buffers of ``model`` that ``tensors`` lacks (a trainer checkpoint holds parameters only).

    Args:
        tensors: the model's names -> tensors.
        model: the model (a meta one is enough).
    """
    params = {k for k, _ in model.named_parameters()}
    return sorted(k for k in model.state_dict() if k not in params and k not in tensors)
