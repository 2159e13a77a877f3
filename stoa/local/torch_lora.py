"""Local mode's torch QLoRA base: the frozen decoder linears quantized (``stoa.models.quant_torch``, MLX's
algorithm, shared with the fleet trainer's quantized base) and the linears that get adapters chosen (the adapters
on top are the fleet trainer's, ``stoa.models.lora_torch``)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from stoa.local.targets import choose_targets, is_expert, is_router
from stoa.models.lora_torch import decoder_blocks
from stoa.models.quant_torch import dequantize_affine, quantize_affine, quantize_linears


def quantize_experts(layer: nn.Module, bits: int, group_size: int) -> int:
    """Replace a layer's routed-expert weights (3-D ``[experts, out, in]`` parameters of its ``experts``
    module) by their quantized values, group-wise along ``in``; returns how many tensors.

    The values equal MLX's ``QuantizedSwitchLinear`` dequantization (each expert row is quantized like a
    linear's), so both backends run the same quantized experts. They are held dequantized in float32 under
    either ``torch_base`` (transformers runs fused experts through its own kernels; no packed kernel here).

    Args:
        layer: a decoder layer.
        bits: 4 or 8.
        group_size: quantization group.
    """
    n = 0
    for path, module in layer.named_modules():
        if not path or not is_expert(path):
            continue
        for p in module.parameters(recurse=False):
            if p.ndim != 3 or p.shape[-1] % group_size:
                continue
            rows = p.detach().reshape(-1, p.shape[-1])
            codes, scales, biases = quantize_affine(rows, bits, group_size)
            with torch.no_grad():
                p.copy_(dequantize_affine(codes, scales, biases).reshape(p.shape).to(p.dtype))
            n += 1
    return n


class Targets(NamedTuple):
    """Which linears of a model get adapters (``quantize_base``'s result)."""

    per_layer: list[list[str]]
    """Per decoder layer, the adapted paths inside it (``stoa.local.targets.choose_targets``)."""
    paths: list[str]
    """The same linears' full module paths, layer by layer (``stoa.models.lora_torch.add_lora``'s ``paths``)."""


def quantize_base(model: nn.Module, *, bits: int, group_size: int, packed: bool, targets: str) -> Targets:
    """Freeze the model, quantize every linear of its decoder blocks, and choose the linears that get adapters.

    Embeddings, the LM head and MoE routers stay in float (the QLoRA convention; routers as on MLX); a linear
    whose input dimension is not a multiple of ``group_size`` stays float too. Routed experts (transformers'
    fused 3-D ``experts`` parameters) are quantized in place by :func:`quantize_experts`. The adapters
    themselves are the fleet trainer's (``stoa.models.lora_torch.add_lora`` on ``Targets.paths``).

    Args:
        model: the HF causal LM (modified in place).
        bits: 4 or 8 quantizes; 16 leaves the base in float.
        group_size: quantization group size.
        packed: ``stoa.models.quant_torch.QuantLinear``'s storage.
        targets: the ``lora_targets`` setting.
    """
    model.requires_grad_(False)
    layers = decoder_blocks(model)
    where = {id(m): n for n, m in model.named_modules()}
    linears = [[n for n, m in layer.named_modules() if isinstance(m, nn.Linear)] for layer in layers]
    if bits < 16:
        for layer in layers:
            quantize_experts(layer, bits, group_size)
    chosen = choose_targets(linears, targets)
    if bits < 16:
        quantize_linears(layers, bits=bits, group_size=group_size, packed=packed, keep=is_router)
    full = [f"{where[id(layer)]}.{p}" for layer, adapt in zip(layers, chosen, strict=True) for p in adapt]
    return Targets(chosen, full)
