"""``stoa local export``: fuse a local run's LoRA adapters into its base and write a Hugging Face directory.

The fused model is what the run computes: each adapted linear becomes ``W + scale * (lora_a @ lora_b)^T`` with
``W`` the base dequantized exactly as training saw it (the quantizer is MLX's, bit for bit, so this holds for
runs of either backend on float32 weights), and every other quantized linear becomes its dequantized weight.
The result is written in float32 (default) or bfloat16. Next to it, under ``OUT/adapters/``, the run's
adapters stay in mlx-lm's adapter layout (``adapters.safetensors`` + ``adapter_config.json``); those were
trained on the quantized base, so apply them to a base quantized the same way
(``quant_bits``/``quant_group_size`` in ``adapter_config.json``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoa.export import ExportError, check_out_dir, write_hf_dir

DTYPES = ("float32", "bfloat16")
ADAPTER_DIR = "adapters"
ADAPTER_FILES = ("adapters.safetensors", "adapter_config.json")


@dataclass(frozen=True)
class LocalExportResult:
    """What a local export wrote.

    Args:
        out: the HF directory.
        adapters: the mlx-lm adapter directory inside it.
        step: the saved step exported.
        dtype: ``float32`` or ``bfloat16``.
        fused: number of adapted linears fused into the base.
        nbytes: size of ``model.safetensors``.
    """

    out: Path
    adapters: Path
    step: int
    dtype: str
    fused: int
    nbytes: int


def fuse_into_linears(model: Any) -> int:
    """Replace every LoRA wrapper and quantized linear of a torch backend's model by a plain ``nn.Linear``.

    Args:
        model: the HF model of a ``TorchBackend`` (modified in place).

    Returns:
        the number of LoRA adapters fused.
    """
    import torch
    from torch import nn

    from stoa.local.torch_lora import LoRALinear, QuantLinear

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
            if isinstance(module, LoRALinear):
                base: Any = module.linear
                w = base.dequantized() if isinstance(base, QuantLinear) else base.weight
                w = w.float() + module.scale * (module.lora_a.float() @ module.lora_b.float()).T
                new = plain(w, base.bias)
                fused += 1
            elif isinstance(module, QuantLinear):
                new = plain(module.dequantized(), module.bias)
            else:
                continue
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return fused


def _load_run(run_dir: Path) -> tuple[Any, Any]:
    """The run's saved state and its config rebuilt for a CPU float32 torch model."""
    from stoa.config import ConfigError
    from stoa.config.local import load_local_config
    from stoa.local.checkpoint import find_latest

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
    import torch

    from stoa.local.torch_backend import TorchBackend
    from stoa.models import resolve_model

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
        backend.load_adapter_arrays(saved.adapters)
    except ValueError as e:
        raise ExportError(f"{saved.path}: {e}; the saved adapters do not fit {cfg.model}") from None
    fused = fuse_into_linears(backend.model)
    tensors = {k: p.detach().to(getattr(torch, dtype)) for k, p in backend.model.named_parameters()}
    echo(f"[export] fused {fused} adapters; writing {len(tensors)} tensors ({dtype}) to {out}")
    nbytes = write_hf_dir(out, tensors, model_dir, dtype)
    adapters = out / ADAPTER_DIR
    adapters.mkdir()
    for name in ADAPTER_FILES:
        shutil.copyfile(saved.path / name, adapters / name)
    return LocalExportResult(out, adapters, saved.step, dtype, fused, nbytes)
