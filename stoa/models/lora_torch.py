"""LoRA adapters on a torch HF causal LM, laid out and named as PEFT does, for the fleet trainer.

Each targeted ``nn.Linear`` keeps its (frozen) ``weight`` and gains two bias-free submodules, ``lora_A``
[r, in] (uniform in +-1/sqrt(in), PEFT's kaiming default) and ``lora_B`` [out, r] (zero, so a fresh adapter
leaves the model unchanged), plus a forward hook adding ``scale * lora_B(lora_A(x))`` with scale = alpha / r.
The base's parameter names are unchanged, and an adapter's are the module's plus ``.lora_A.weight``: PEFT's
saved keys are ``base_model.model.`` + that (``peft_state``). The merged weight is ``W + scale * B @ A``.

Local mode has its own LoRA wrappers (``stoa.local.torch_lora``, mlx-lm's layout); they should merge into this
module once local mode runs through the trainer (issue 28).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file
from torch import nn

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections, as PEFT names them."""
PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a module path in its saved adapter keys."""


@dataclass(frozen=True)
class LoraSpec:
    """What an adapter is: its rank, alpha and the module-name suffixes it adapts."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = DEFAULT_TARGETS

    @property
    def scale(self) -> float:
        """alpha / rank, the factor on ``B @ A``."""
        return self.alpha / self.rank

    def describe(self) -> str:
        """The adapter's identity in one string (``r=16,alpha=32,targets=q_proj,k_proj``)."""
        return f"r={self.rank},alpha={self.alpha:g},targets={','.join(self.targets)}"


def matches(name: str, targets: Iterable[str]) -> bool:
    """Whether module path ``name`` ends with one of ``targets`` at a name boundary (PEFT's suffix rule).

    Args:
        name: a module path (``model.layers.0.self_attn.q_proj``).
        targets: module-name suffixes.
    """
    return any(name == t or name.endswith("." + t) for t in targets)


def _lora_hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """The base output plus the scaled low-rank update (computed in the adapter's dtype, returned in the base's)."""
    a, b = module.get_submodule("lora_A"), module.get_submodule("lora_B")
    assert isinstance(a, nn.Linear)
    x = args[0]
    delta = b(a(x.to(a.weight.dtype)))
    return out + (float(module.__dict__["lora_scale"]) * delta).to(out.dtype)


def add_lora(model: nn.Module, spec: LoraSpec, seed: int) -> list[str]:
    """Freeze ``model`` and add a float32 adapter to every ``nn.Linear`` a target names; the adapted paths.

    The initialisation depends only on ``seed`` and the module order (every rank of a sharded trainer draws the
    same adapter).

    Args:
        model: the HF causal LM (modified in place).
        spec: rank, alpha, targets.
        seed: seed of the ``lora_A`` initialisation.

    Raises:
        ValueError: no linear matches the targets.
    """
    model.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    paths = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and matches(n, spec.targets)]
    if not paths:
        raise ValueError(f"lora_targets {','.join(spec.targets)!r} name no linear layer of "
                         f"{type(model).__name__}; name module suffixes such as q_proj,v_proj")
    for path in paths:
        lin = model.get_submodule(path)
        assert isinstance(lin, nn.Linear)
        dev = lin.weight.device
        a = nn.Linear(lin.in_features, spec.rank, bias=False, dtype=torch.float32)
        bound = 1.0 / math.sqrt(lin.in_features)
        with torch.no_grad():
            a.weight.copy_(torch.empty(spec.rank, lin.in_features).uniform_(-bound, bound, generator=gen))
        b = nn.Linear(spec.rank, lin.out_features, bias=False, dtype=torch.float32)
        nn.init.zeros_(b.weight)
        lin.add_module("lora_A", a.to(dev))
        lin.add_module("lora_B", b.to(dev))
        lin.__dict__["lora_scale"] = spec.scale  # a plain float, not a parameter or buffer
        lin.register_forward_hook(_lora_hook)
    return paths


def adapted_linears(model: nn.Module, paths: Iterable[str]) -> dict[str, tuple[int, int]]:
    """The adapted linears' shapes, module path -> (out, in): what an adapter tensor must fit
    (``stoa.weights.adapter.check_adapter``).

    Args:
        model: the model.
        paths: the adapted module paths (``add_lora``'s result).
    """
    out: dict[str, tuple[int, int]] = {}
    for path in paths:
        lin = model.get_submodule(path)
        assert isinstance(lin, nn.Linear)
        out[path] = (lin.out_features, lin.in_features)
    return out


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` belongs to an adapter (``...lora_A.weight`` or ``...lora_B.weight``).

    Args:
        name: a parameter name.
    """
    return name.endswith((".lora_A.weight", ".lora_B.weight"))


def merge_arrays(arrays: Mapping[str, np.ndarray], paths: Iterable[str], scale: float) -> dict[str, np.ndarray]:
    """The base's tensors with every adapted weight merged (``W + scale * B @ A``, float32) and no adapter keys.

    New arrays are made for the merged weights; the inputs (which may share memory with live parameters) are
    never written.

    Args:
        arrays: full tensors by name, the adapters' included.
        paths: the adapted module paths.
        scale: alpha / rank.
    """
    out = {k: v for k, v in arrays.items() if not is_adapter(k)}
    for path in paths:
        b, a = arrays[f"{path}.lora_B.weight"], arrays[f"{path}.lora_A.weight"]
        w = out[f"{path}.weight"]
        out[f"{path}.weight"] = (w.astype(np.float32) + np.float32(scale) * (b.astype(np.float32) @ a.astype(
            np.float32))).astype(np.float32)
    return out


def peft_state(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The adapter tensors under PEFT's saved names (``base_model.model.<module>.lora_A.weight``).

    Args:
        arrays: tensors by parameter name; only the adapters' are kept.
    """
    return {PEFT_PREFIX + k: np.ascontiguousarray(v, dtype=np.float32) for k, v in arrays.items() if is_adapter(k)}


def peft_config(spec: LoraSpec, base_model: str) -> dict[str, object]:
    """PEFT's ``adapter_config.json`` for ``spec`` (``peft_type`` LORA, no dropout, no bias).

    Args:
        spec: the adapter.
        base_model: what ``base_model_name_or_path`` names (the model setting).
    """
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
            "target_modules": list(spec.targets), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "init_lora_weights": True, "inference_mode": True,
            "base_model_name_or_path": base_model}


def write_peft(directory: str | Path, arrays: Mapping[str, np.ndarray], spec: LoraSpec, base_model: str) -> Path:
    """Write ``adapter_model.safetensors`` and ``adapter_config.json`` (PEFT loads them); the directory.

    Args:
        directory: where (created).
        arrays: tensors by parameter name (the adapters' are written).
        spec: the adapter.
        base_model: ``base_model_name_or_path``.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file(peft_state(arrays), str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
    (d / "adapter_config.json").write_text(json.dumps(peft_config(spec, base_model), indent=2, sort_keys=True))
    return d
