"""``stoa local export``: fuse a local run's LoRA adapters into its base and write a Hugging Face directory.

The fused model is what the run computes: each adapted linear becomes ``W + scale * (lora_a @ lora_b)^T`` with ``W``
the base dequantized exactly as training saw it (the quantizer is MLX's, bit for bit, so this holds for runs of
either backend on float32 weights), and every other quantized linear becomes its dequantized weight. The result is
written in float32 (default) or bfloat16 under the tensor names of the family's own Hugging Face checkpoints, by
``stoa export``'s writer (``checkpoint_names``: fused MoE experts are split per expert again; ``write_hf_dir``;
buffers such as LFM2-MoE's ``expert_bias`` are kept), so ``transformers`` and ``mlx_lm.load`` both open it. A run of
the MLX backend is read through its mlx-lm adapter names, mapped onto transformers' modules. Next to the model,
under ``OUT/adapters/``, the run's adapters stay as saved (``adapters.safetensors`` + ``adapter_config.json``,
mlx-lm's adapter layout), and under ``OUT/adapter/`` the same adapters as PEFT files, written by the fleet trainer's
``write_peft`` (the layout of its checkpoints' ``adapter/``; ``PeftModel.from_pretrained`` and ``stoa export``'s
merge read them). Both were trained on the quantized base, so apply them to a base quantized the same way
(``quant_bits``/``quant_group_size`` in the mlx-lm ``adapter_config.json``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoa.config import ConfigError
from stoa.config.local import load_local_config
from stoa.local.saved import find_latest
from stoa.models import resolve_model
from stoa.models.hf_dir import ExportError, check_out_dir, checkpoint_names, write_hf_dir

DTYPES = ("float32", "bfloat16")
ADAPTER_DIR = "adapters"
ADAPTER_FILES = ("adapters.safetensors", "adapter_config.json")
PEFT_DIR = "adapter"
"""Where the PEFT adapter goes (the name of the trainer checkpoint's PEFT directory)."""


@dataclass(frozen=True)
class LocalExportResult:
    """What a local export wrote.

    Args:
        out: the HF directory.
        adapters: the mlx-lm adapter directory inside it.
        peft: the PEFT adapter directory inside it.
        step: the saved step exported.
        dtype: ``float32`` or ``bfloat16``.
        fused: number of adapted linears fused into the base.
        nbytes: size of the weight files (``*.safetensors``).
    """

    out: Path
    adapters: Path
    peft: Path
    step: int
    dtype: str
    fused: int
    nbytes: int


def fuse_into_linears(model: Any) -> int:
    """Replace every adapted linear and quantized linear of a torch backend's model by a plain ``nn.Linear``
    (an adapted one holds ``W + scale * B @ A``: ``stoa.models.lora_torch.lora_delta``, as the trainer merges).

    Args:
        model: the HF model of a ``TorchBackend`` (modified in place).

    Returns:
        the number of LoRA adapters fused.
    """
    import torch
    from torch import nn

    from stoa.models.lora_torch import lora_delta
    from stoa.models.quant_torch import QuantLinear

    def plain(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        with torch.no_grad():
            lin.weight.copy_(weight)
            if bias is not None:
                lin.bias.copy_(bias)
        return lin

    fused = 0
    with torch.no_grad():
        for name, module in list(model.named_modules()):
            adapted = "lora_scale" in module.__dict__
            if not adapted and not isinstance(module, QuantLinear):
                continue
            w = module.dequantized() if isinstance(module, QuantLinear) else module.weight
            new = plain(w.float() + lora_delta(module) if adapted else w, module.bias)
            fused += adapted
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return fused


def _load_run(run_dir: Path) -> tuple[Any, Any]:
    """The run's saved state and its config rebuilt for a CPU float32 torch model."""

    if not run_dir.is_dir():
        raise ExportError(f"{run_dir} is not a directory; give the output_dir of a local run")
    try:
        saved = find_latest(run_dir)
    except ValueError as e:
        raise ExportError(str(e)) from None
    if saved is None or not (run_dir / "config.toml").is_file():
        raise ExportError(f"{run_dir} holds no saved local run (no latest.json and config.toml); give the "
                          "output_dir of a run that saved at least once (checkpoint_every > 0, or a finished "
                          "run)")
    over = {"backend": "torch", "device": "cpu", "dtype": "float32", "torch_base": "dequantized",
            "gradient_checkpointing": False}
    try:
        cfg = load_local_config(str(run_dir / "config.toml"), over)
    except ConfigError as e:
        raise ExportError(f"{run_dir / 'config.toml'}: {e}") from None
    return saved, cfg


MLX_RENAMES = {"feed_forward.gate_proj": "feed_forward.w1", "feed_forward.up_proj": "feed_forward.w3",
               "feed_forward.down_proj": "feed_forward.w2"}
"""mlx-lm module paths whose transformers module has another name (LFM2-MoE's dense blocks)."""
MLX_PREFIXES = ("language_model.",)
"""Prefixes of mlx-lm adapter names that transformers' modules lack (qwen3.5's text model)."""


def torch_adapter_names(arrays: dict[str, Any], expected: set[str]) -> dict[str, Any]:
    """Saved adapters renamed to the torch backend's names (an MLX run's names differ on some families).

    A name already expected is kept; otherwise a leading :data:`MLX_PREFIXES` entry is dropped and the
    :data:`MLX_RENAMES` module paths are renamed, when that yields an expected name.

    Args:
        arrays: saved adapter name -> array.
        expected: the torch backend's adapter names.
    """
    out: dict[str, Any] = {}
    for name, value in arrays.items():
        new = name
        if new not in expected:
            new = next((new[len(p):] for p in MLX_PREFIXES if new.startswith(p)), new)
            for old_path, torch_path in MLX_RENAMES.items():
                new = new.replace(f".{old_path}.", f".{torch_path}.")
        out[new if new in expected else name] = value
    return out


def save_fused(model: Any, out: Path, model_dir: Path, dtype: str) -> int:
    """Write a fused model as ``stoa export`` writes a run's weights: its tensors (``model_tensors``: parameters,
    tied ones once, and the checkpoint's buffers) under the family's checkpoint names (``checkpoint_names``), with
    the config and tokenizer files of ``model_dir`` (``write_hf_dir``).

    Args:
        model: the fused HF model.
        out: the target directory.
        model_dir: the base model's directory (config and tokenizer files).
        dtype: ``float32`` or ``bfloat16``.

    Returns:
        the size of ``model.safetensors`` in bytes.
    """
    import torch

    from stoa.engines.torch import model_tensors

    cast = getattr(torch, dtype)
    tensors = {k: v.detach().to(cast) for k, v in model_tensors(model).items()}
    return write_hf_dir(out, checkpoint_names(tensors, model), model_dir, dtype)


def export_local(run_dir: str | os.PathLike[str], out: str | os.PathLike[str], *, dtype: str = "float32",
                 echo: Callable[[str], Any] = print) -> LocalExportResult:
    """Fuse the adapters of a local run's latest saved state into its base and write an HF directory.

    Args:
        run_dir: the run's ``output_dir``.
        out: a new (or empty) directory.
        dtype: ``float32`` or ``bfloat16``.
        echo: progress lines.

    Raises:
        ExportError: no saved run in ``run_dir``, an unknown dtype, OUT not empty.
    """
    from stoa.local.torch_backend import TorchBackend
    from stoa.models.lora_torch import write_peft

    run_dir, out = Path(run_dir), Path(out)
    if dtype not in DTYPES:
        raise ExportError(f"unknown --dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    check_out_dir(out)
    saved, cfg = _load_run(run_dir)
    echo(f"[export] {run_dir}: step {saved.step}, {cfg.model}, {cfg.quant_bits}-bit base, "
         f"LoRA rank {cfg.lora_rank}")
    model_dir = resolve_model(cfg.model)
    backend = TorchBackend(cfg, model_dir)
    try:
        backend.load_adapter_arrays(torch_adapter_names(saved.adapters, set(backend.adapter_arrays())))
    except ValueError as e:
        raise ExportError(f"{saved.path}: {e}; the saved adapters do not fit {cfg.model}") from None
    peft = write_peft(out / PEFT_DIR, backend.peft_arrays(), backend.spec, cfg.model)
    fused = fuse_into_linears(backend.model)
    echo(f"[export] fused {fused} adapters; writing the model ({dtype}) to {out}")
    nbytes = save_fused(backend.model, out, model_dir, dtype)
    adapters = out / ADAPTER_DIR
    adapters.mkdir()
    for name in ADAPTER_FILES:
        shutil.copyfile(saved.path / name, adapters / name)
    return LocalExportResult(out, adapters, peft, saved.step, dtype, fused, nbytes)
