"""Weights in torch/HF naming into an mlx-lm model: names mapped, every tensor checked, then loaded at once.

Published states and trainer arrays carry transformers' ``named_parameters`` names. mlx-lm's ``sanitize``
maps most of them (tied heads, conv layouts, qwen3.5's ``language_model.`` prefix and norm offsets); two things
it does not, done here first:

* transformers 5 fuses each MoE layer's experts into ``<p>.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows
  first) and ``<p>.experts.down_proj`` ``[E, H, I]``; mlx-lm's qwen3-moe and lfm2-moe expect the per-expert
  checkpoint names. Both become ``<p>.switch_mlp.{gate,up,down}_proj.weight`` (mlx-lm's ``SwitchLinear``).
  An int8g64 expert tensor (codes ``<name>``, ``<name>.scales``, ``<name>.biases``, the layout of
  ``mx.quantize`` on the 3-D tensor: groups along the input axis) splits the same way, exactly, since the
  split is across output rows.
* lfm2-moe's ``expert_bias`` is a router buffer in transformers, not a parameter, so no state carries it:
  the model keeps the value it was built with (its checkpoint's).
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from stoa.engines.mlx.quantized import use_blas_for_quantized
from stoa.weights.planes import BITS, GROUP_SIZE

IGNORED_BUFFERS = ("rotary_emb.inv_freq",)
"""Names a model's ``sanitize`` may drop without the state being wrong (recomputed buffers)."""
KEPT_BUFFERS = ("expert_bias",)
"""Model tensors a state may leave out (transformers buffers, never trained): the model keeps its own."""
QUANT_SUFFIXES = (".scales", ".biases")
_FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}

Expected = dict[str, tuple[tuple[int, ...], str]]
"""Tensor name -> (shape, kind: ``uint32`` codes or ``float``)."""


def quant_prefix(name: str) -> str:
    """The layer a tensor's ``.scales`` / ``.biases`` are named after: ``<p>.weight`` -> ``<p>``; a fused
    expert tensor (no ``.weight``) is its own prefix."""
    return name[: -len(".weight")] if name.endswith(".weight") else name


def unfuse_experts(arrays: dict[str, mx.array]) -> dict[str, mx.array]:
    """transformers' fused expert tensors (and their int8g64 scales/biases) as mlx-lm ``switch_mlp`` ones."""
    out: dict[str, mx.array] = {}
    for name, a in arrays.items():
        base, suffix = name, ".weight"
        for s in QUANT_SUFFIXES:
            if name.endswith(s):
                base, suffix = name[: -len(s)], s
        layer, _, fused = base.rpartition(".experts.")
        if not layer or fused not in _FUSED:
            out[name] = a
            continue
        parts = _FUSED[fused]
        rows = a.shape[-2] // len(parts)
        for i, part in enumerate(parts):
            out[f"{layer}.switch_mlp.{part}{suffix}"] = a[..., i * rows : (i + 1) * rows, :]
    return out


def to_model_names(model: Any, arrays: dict[str, mx.array]) -> dict[str, mx.array]:
    """Map torch/HF names onto the model's (fused experts, then its ``sanitize``); a dropped real tensor is an
    error.

    ``sanitize`` renames and stacks ``.weight`` tensors only (lfm2's ``w1`` -> ``gate_proj``, per-expert
    stacks), so int8g64 scales and biases go through it a second and third time, named as weights.
    """
    arrays = unfuse_experts(arrays)
    if not hasattr(model, "sanitize"):
        return arrays
    main = {k: v for k, v in arrays.items() if not k.endswith(QUANT_SUFFIXES)}
    out = model.sanitize(dict(main))
    dropped = sorted(k for k in set(main) - set(out) if not k.endswith(IGNORED_BUFFERS))
    if dropped and not set(out) - set(main):
        tied = " (the model ties its embeddings)" if "lm_head.weight" in dropped else ""
        raise ValueError(f"unexpected tensor {dropped[0]!r}{tied}; unexpected: {dropped[:5]}")
    for suffix in QUANT_SUFFIXES:
        side = {f"{k[: -len(suffix)]}.weight": v for k, v in arrays.items() if k.endswith(suffix)}
        if side:
            out |= {f"{k.removesuffix('.weight')}{suffix}": v for k, v in model.sanitize(side).items()}
    return out


def _is_quantized(module: Any) -> bool:
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    return isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding | QuantizedSwitchLinear)


def expected_tensors(model: Any, quant: set[str], bits: int = BITS) -> tuple[Expected, set[str]]:
    """Shape and kind of every tensor the model takes once the layers named in ``quant`` are quantized (2-D
    linears and embeddings, 3-D ``SwitchLinear`` experts) with ``bits`` per code, and which layers still have to be
    quantized."""
    expected: Expected = {
        k: (tuple(v.shape), "uint32" if v.dtype == mx.uint32 else "float")
        for k, v in cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    }
    to_quantize: set[str] = set()
    for path, module in model.named_modules():
        is_q = _is_quantized(module)
        if path in quant and not is_q:
            if not hasattr(module, "to_quantized"):
                raise ValueError(f"{path}.scales: layer {path!r} ({type(module).__name__}) cannot be quantized")
            *lead, cols = module.weight.shape
            if cols % GROUP_SIZE:
                raise ValueError(f"{path}.weight: input dimension {cols} is not a multiple of {GROUP_SIZE}")
            expected[f"{path}.weight"] = ((*lead, cols * bits // 32), "uint32")
            for suffix in QUANT_SUFFIXES:
                expected[path + suffix] = ((*lead, cols // GROUP_SIZE), "float")
            to_quantize.add(path)
        elif is_q and path not in quant:
            raise ValueError(f"{path}.scales: missing; this engine already holds quantized (int8g64, int4g64) layers "
                             "(build a new engine to load another plane)")
    return expected, to_quantize


def install(model: Any, arrays: dict[str, mx.array], bits: int = BITS) -> None:
    """Check every name, shape and dtype against the model, then load all at once (nothing on a mismatch); quantized
    layers take ``bits`` per code (8: int8g64, 4: a LoRA run's int4g64 base)."""
    arrays = to_model_names(model, arrays)
    quant = {k[: -len(".scales")] for k in arrays if k.endswith(".scales")}
    expected, to_quantize = expected_tensors(model, quant, bits)
    missing = sorted(k for k in set(expected) - set(arrays) if not k.endswith(KEPT_BUFFERS))
    extra = sorted(set(arrays) - set(expected))
    if missing or extra:
        first = f"missing tensor {missing[0]!r}" if missing else f"unexpected tensor {extra[0]!r}"
        raise ValueError(f"weights do not match the model: {first}; missing={missing[:5]} unexpected={extra[:5]}")
    for name, (shape, kind) in expected.items():
        if name not in arrays:
            continue  # a kept buffer
        a = arrays[name]
        if tuple(a.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(a.shape)} != model {shape}")
        if (a.dtype == mx.uint32) != (kind == "uint32"):
            raise ValueError(f"{name}: dtype {a.dtype} does not fit the model's layer ({kind})")
    if to_quantize:
        nn.quantize(model, group_size=GROUP_SIZE, bits=bits, class_predicate=lambda p, m: p in to_quantize)
        use_blas_for_quantized(model)
    model.load_weights(list(arrays.items()), strict=len(arrays) == len(expected))
    mx.eval(model.parameters())


def cast_model(model: Any, dtype: mx.Dtype) -> None:
    """Cast the model's float parameters to ``dtype``, except those its ``cast_predicate`` keeps (qwen3.5's
    ``A_log``, lfm2-moe's ``expert_bias`` stay float32, as mlx-lm's own conversion leaves them)."""
    keep = getattr(model, "cast_predicate", lambda _: True)
    params = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    model.load_weights([(k, v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and keep(k) else v)
                        for k, v in params], strict=False)
