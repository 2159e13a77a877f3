"""LoRA adapters on a torch HF causal LM, laid out and named as PEFT does, for the fleet trainer and local mode.

Each targeted ``nn.Linear`` keeps its (frozen) ``weight`` and gains two bias-free submodules, ``lora_A``
[r, in] (uniform in +-1/sqrt(in), PEFT's kaiming default) and ``lora_B`` [out, r] (zero, so a fresh adapter
leaves the model unchanged), plus a forward hook adding ``scale * lora_B(lora_A(x))`` with scale = alpha / r.
The base's parameter names are unchanged, and an adapter's are the module's plus ``.lora_A.weight``: PEFT's
saved keys are ``base_model.model.`` + that (``peft_state``). The merged weight is ``W + scale * B @ A``.

Local mode's torch backend uses these adapters too, on its quantized linears (``stoa.models.quant_torch.QuantLinear``,
any module with ``in_features``/``out_features``), at the paths its target rule picks (``add_lora(paths=...)``); its
saved state keeps mlx-lm's adapter names and layout (``to_mlx_lm``: ``<module>.lora_a`` [in, r], ``.lora_b``
[r, out]), which the MLX backend trains, and ``lora_disabled`` bypasses every adapter (the reference policy of
both: a LoRA fleet run's ``stoa.trainer.policy.BaseView``). ``stoa local export`` writes the PEFT files with
``write_peft`` too, naming exactly the adapted linears (``peft_targets``).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder blocks of an HF causal LM (FSDP2's and activation checkpointing's unit; where local mode's
    torch backend quantizes linears and picks adapter targets).

    Args:
        model: the model.
    """
    layers = getattr(model.get_decoder(), "layers", None)  # type: ignore[operator]
    if layers is not None:
        return list(layers)
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def matches(name: str, targets: Iterable[str]) -> bool:
    """Whether module path ``name`` ends with one of ``targets`` at a name boundary (PEFT's suffix rule).

    Args:
        name: a module path (``model.layers.0.self_attn.q_proj``).
        targets: module-name suffixes.
    """
    return any(name == t or name.endswith("." + t) for t in targets)


class LoraDelta(torch.autograd.Function):
    """``scale * B(A(x))`` for an adapter of ``x``'s linear, with the values and gradients of autograd's
    ``scale * b(a(x.to(A.dtype)))`` (tested bit-equal), but backward keeps ``x`` itself and the rank-``r``
    product, not the adapter-dtype copy of ``x`` that autograd keeps for every adapted linear (q, k and v each kept
    their own copy of one input). ``compute``: the products' dtype, the adapter's own (fp32) or, under autocast,
    autocast's (bf16: the adapter's weights are cast per call, as autocast does)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, a_weight: torch.Tensor, b_weight: torch.Tensor, scale: float,
                compute: torch.dtype) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            u = nn.functional.linear(x.to(compute), a_weight.to(compute))
            out = scale * nn.functional.linear(u, b_weight.to(compute))
        ctx.save_for_backward(x, u, a_weight, b_weight)
        ctx.scale, ctx.compute = scale, compute
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, u, a_weight, b_weight = ctx.saved_tensors
        c = ctx.compute
        with torch.autocast(x.device.type, enabled=False):
            g = (grads[0].to(c) * ctx.scale).flatten(0, -2)
            du = g.mm(b_weight.to(c))
            grad_b = g.t().mm(u.flatten(0, -2)).to(b_weight.dtype) if ctx.needs_input_grad[2] else None
            grad_a = (du.t().mm(x.flatten(0, -2).to(c)).to(a_weight.dtype) if ctx.needs_input_grad[1] else None)
            grad_x = du.mm(a_weight.to(c)).to(x.dtype).reshape(x.shape) if ctx.needs_input_grad[0] else None
        return grad_x, grad_a, grad_b, None, None


def _lora_hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """The base output plus the scaled low-rank update (computed in the adapter's dtype, returned in the base's)."""
    if not module.__dict__.get("lora_on", True):
        return out
    a, b = module.get_submodule("lora_A"), module.get_submodule("lora_B")
    assert isinstance(a, nn.Linear) and isinstance(b, nn.Linear)
    x, kind, scale = args[0], args[0].device.type, float(module.__dict__["lora_scale"])
    compute = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else a.weight.dtype
    if torch.is_autocast_enabled(kind) and x.dtype != compute:  # fp32 activations under autocast: autograd's chain
        return out + (scale * b(a(x.to(a.weight.dtype)))).to(out.dtype)
    return out + LoraDelta.apply(x, a.weight, b.weight, scale, compute).to(out.dtype)


def _adaptable(m: nn.Module) -> bool:
    """Whether ``m`` is a linear an adapter can wrap: ``nn.Linear`` or a quantized one (``in_features`` and
    ``out_features`` set, as ``stoa.models.quant_torch.QuantLinear``)."""
    return isinstance(m, nn.Linear) or (isinstance(getattr(m, "in_features", None), int)
                                        and isinstance(getattr(m, "out_features", None), int))


def _device(m: nn.Module) -> torch.device:
    """Where a (possibly quantized, parameter-free) linear lives."""
    t = next(iter(m.parameters()), None)
    t = t if t is not None else next(iter(m.buffers()), None)
    return t.device if t is not None else torch.device("cpu")


def add_lora(model: nn.Module, spec: LoraSpec, seed: int, paths: Sequence[str] | None = None) -> list[str]:
    """Freeze ``model`` and add a float32 adapter to every linear a target names (or to ``paths``); the adapted paths.

    The initialisation depends only on ``seed`` and the order of the paths (every rank of a sharded trainer draws
    the same adapter).

    Args:
        model: the HF causal LM (modified in place).
        spec: rank, alpha, targets.
        seed: seed of the ``lora_A`` initialisation.
        paths: the module paths to adapt (local mode's target rule, ``stoa.local.targets``); None: every
            ``nn.Linear`` whose name ends with one of ``spec.targets``.

    Raises:
        ValueError: no linear matches the targets, or a path is not a linear.
    """
    model.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    if paths is None:
        paths = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and matches(n, spec.targets)]
    if not paths:
        raise ValueError(f"lora_targets {','.join(spec.targets)!r} name no linear layer of "
                         f"{type(model).__name__}; name module suffixes such as q_proj,v_proj")
    for path in paths:
        lin = model.get_submodule(path)
        if not _adaptable(lin):
            raise ValueError(f"{path} is a {type(lin).__name__}, not a linear; adapt linear layers only")
        in_f, out_f = int(lin.in_features), int(lin.out_features)  # type: ignore[arg-type]
        a = nn.Linear(in_f, spec.rank, bias=False, dtype=torch.float32)
        bound = 1.0 / math.sqrt(in_f)
        with torch.no_grad():
            a.weight.copy_(torch.empty(spec.rank, in_f).uniform_(-bound, bound, generator=gen))
        b = nn.Linear(spec.rank, out_f, bias=False, dtype=torch.float32)
        nn.init.zeros_(b.weight)
        dev = _device(lin)
        lin.add_module("lora_A", a.to(dev))
        lin.add_module("lora_B", b.to(dev))
        lin.__dict__["lora_scale"] = spec.scale  # a plain float, not a parameter or buffer
        lin.register_forward_hook(_lora_hook)
    return list(paths)


def peft_targets(model: nn.Module, paths: Sequence[str]) -> tuple[str, ...]:
    """``target_modules`` that name exactly the linears ``paths`` by PEFT's suffix rule: their leaf names when those
    pick no other linear of ``model``, else the full paths (a rule such as local mode's that adapts a leaf in some
    layers only).

    Args:
        model: the model (before or after ``add_lora``).
        paths: the adapted module paths.
    """
    leaves = tuple(sorted({p.rsplit(".", 1)[-1] for p in paths}))
    hit = {n for n, m in model.named_modules() if n and _adaptable(m) and matches(n, leaves)}
    return leaves if hit == set(paths) else tuple(paths)


@contextlib.contextmanager
def lora_disabled(model: nn.Module) -> Iterator[None]:
    """Bypass every adapter of ``model`` inside the block (the base alone: local mode's reference policy).

    Args:
        model: a model ``add_lora`` adapted.
    """
    adapted = [m for m in model.modules() if "lora_scale" in m.__dict__]
    for m in adapted:
        m.__dict__["lora_on"] = False
    try:
        yield
    finally:
        for m in adapted:
            m.__dict__["lora_on"] = True


def lora_delta(lin: nn.Module) -> torch.Tensor:
    """An adapted linear's weight update ``scale * B @ A`` [out, in] in float32 (what a merge adds to ``W``).

    Args:
        lin: a linear ``add_lora`` adapted.
    """
    a, b = lin.get_submodule("lora_A"), lin.get_submodule("lora_B")
    assert isinstance(a, nn.Linear) and isinstance(b, nn.Linear)
    return float(lin.__dict__["lora_scale"]) * (b.weight.float() @ a.weight.float())


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
        assert _adaptable(lin)
        out[path] = (int(lin.out_features), int(lin.in_features))  # type: ignore[arg-type]
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


MLX_LM_LEAVES = {".lora_A.weight": ".lora_a", ".lora_B.weight": ".lora_b"}
"""PEFT's adapter leaves and mlx-lm's (``lora_a`` [in, r] and ``lora_b`` [r, out]: PEFT's matrices transposed)."""


def mlx_lm_name(name: str) -> str:
    """An adapter parameter's mlx-lm name (``...q_proj.lora_A.weight`` -> ``...q_proj.lora_a``); other names unchanged.

    Args:
        name: a parameter name.
    """
    for peft, mlx in MLX_LM_LEAVES.items():
        if name.endswith(peft):
            return name[: -len(peft)] + mlx
    return name


def to_mlx_lm(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Adapter tensors under mlx-lm's names and layout (each matrix transposed), float32; the keys of
    ``from_mlx_lm``'s input.

    Args:
        arrays: adapter tensors by parameter name (``...lora_A.weight`` [r, in], ``...lora_B.weight`` [out, r]).
    """
    return {mlx_lm_name(k): np.ascontiguousarray(np.asarray(v, np.float32).T) for k, v in arrays.items()
            if is_adapter(k)}


def from_mlx_lm(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse of ``to_mlx_lm``: mlx-lm adapter tensors (``.lora_a``/``.lora_b``) under PEFT's parameter names.

    Args:
        arrays: mlx-lm adapter tensors by name.

    Raises:
        ValueError: a name that is not an mlx-lm adapter leaf.
    """
    out: dict[str, np.ndarray] = {}
    for k, v in arrays.items():
        peft = next((k[: -len(mlx)] + p for p, mlx in MLX_LM_LEAVES.items() if k.endswith(mlx)), None)
        if peft is None:
            raise ValueError(f"adapter state: {k!r} is not an mlx-lm adapter name (<module>.lora_a or .lora_b)")
        out[peft] = np.ascontiguousarray(np.asarray(v, np.float32).T)
    return out
