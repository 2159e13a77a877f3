"""Torch QLoRA base: MLX-identical group-wise affine quantization of the frozen linears (the adapters on top are
the fleet trainer's, ``stoa.models.lora_torch``)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from stoa.local.targets import choose_targets, is_expert, is_router
from stoa.models.lora_torch import decoder_blocks


def quantize_affine(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize [out, in] like ``mx.quantize(w, group_size, bits)`` (affine mode) in float32.

    Per group of ``group_size`` along the input dimension: scale = max((max - min) / (2^bits - 1), 1e-7),
    signed so that the edge with the larger magnitude is hit exactly (scale = edge / rint(edge / scale),
    bias = edge) unless that code is 0 (then bias = 0); codes = clip(rint((w - bias) / scale)). The same
    steps as MLX, so dequantized values match MLX's bit for bit on float32 weights (tested).

    Args:
        w: [out, in] weights, in % group_size == 0.
        bits: 4 or 8.
        group_size: 32, 64 or 128.

    Returns:
        (uint8 codes [out, in], float32 scales [out, in / group_size], float32 biases likewise).
    """
    out_d, in_d = w.shape
    if in_d % group_size:
        raise ValueError(f"input dimension {in_d} is not a multiple of quant_group_size {group_size}")
    x = w.detach().float().reshape(out_d, in_d // group_size, group_size)
    w_max, w_min = x.amax(-1), x.amin(-1)
    n_bins = float((1 << bits) - 1)
    scale = torch.clamp((w_max - w_min) / n_bins, min=1e-7)
    use_min = w_min.abs() > w_max.abs()
    scale = torch.where(use_min, scale, -scale)
    edge = torch.where(use_min, w_min, w_max)
    q0 = torch.round(edge / scale)
    exact = q0 != 0
    scale = torch.where(exact, edge / torch.where(exact, q0, torch.ones_like(q0)), scale)
    bias = torch.where(exact, edge, torch.zeros_like(edge))
    q = torch.round((x - bias[..., None]) / scale[..., None])
    q = torch.nan_to_num(q, nan=0.0).clamp_(0, n_bins)
    return q.to(torch.uint8).reshape(out_d, in_d), scale, bias


def dequantize_affine(codes: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
    """``codes * scale + bias`` per group, in the scales' dtype (MLX's ``mx.dequantize`` on float32).

    Args:
        codes: [out, in] integer codes.
        scales: [out, groups].
        biases: [out, groups].
    """
    out_d, in_d = codes.shape
    groups = scales.shape[1]
    q = codes.reshape(out_d, groups, in_d // groups).to(scales.dtype)
    return (q * scales[..., None] + biases[..., None]).reshape(out_d, in_d)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte, the even index in the low nibble.

    Args:
        codes: uint8 [out, in] codes < 16, in even.
    """
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_nibbles``.

    Args:
        packed: uint8 [out, in / 2].
    """
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


class _PackedLinearFn(torch.autograd.Function):
    """y = x W^T with W dequantized on the fly; backward dequantizes again instead of saving W."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:  # type: ignore[override]
        ctx.layer = layer
        return nn.functional.linear(x, layer.dequantized().to(x.dtype), layer.bias)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        w = ctx.layer.dequantized().to(grad_y.dtype)
        return grad_y @ w, None


class QuantLinear(nn.Module):
    """A frozen linear quantized group-wise (affine, MLX's algorithm), held dequantized or packed.

    Args:
        linear: the float linear to quantize (its weight is not kept).
        bits: 4 or 8.
        group_size: quantization group along the input dimension.
        packed: keep only the codes (4-bit: two per byte) and dequantize per call; otherwise expand the
            codes once into a float32 ``weight`` buffer (same numbers, faster on CPU, float32 memory).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, bits: int, group_size: int, packed: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bits, self.group_size, self.packed = bits, group_size, packed
        codes, scales, biases = quantize_affine(linear.weight, bits, group_size)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        if packed:
            self.register_buffer("codes", pack_nibbles(codes) if bits == 4 else codes)
            self.register_buffer("scales", scales)
            self.register_buffer("biases", biases)
        else:
            self.register_buffer("weight", dequantize_affine(codes, scales, biases))

    def dequantized(self) -> torch.Tensor:
        """The [out, in] weight values (float32)."""
        if not self.packed:
            return self.weight
        codes = unpack_nibbles(self.codes) if self.bits == 4 else self.codes
        return dequantize_affine(codes, self.scales, self.biases)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T (+ bias) with the quantized weight.

        Args:
            x: [..., in] activations.
        """
        if self.packed:
            return _PackedLinearFn.apply(x, self)  # type: ignore[return-value]
        return nn.functional.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, packed={self.packed}")


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
        packed: ``QuantLinear``'s storage.
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
    for layer, paths in zip(layers, linears, strict=True):
        for path in paths:
            parent_path, _, leaf = path.rpartition(".")
            parent = layer.get_submodule(parent_path) if parent_path else layer
            module: nn.Module = getattr(parent, leaf)
            if (bits < 16 and isinstance(module, nn.Linear) and module.in_features % group_size == 0
                    and not is_router(path)):
                setattr(parent, leaf, QuantLinear(module, bits, group_size, packed))
    full = [f"{where[id(layer)]}.{p}" for layer, adapt in zip(layers, chosen, strict=True) for p in adapt]
    return Targets(chosen, full)
