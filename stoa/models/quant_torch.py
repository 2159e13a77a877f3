"""Group-wise affine quantization of frozen torch linears (MLX's algorithm): local mode's QLoRA base
(``stoa.local.torch_lora.quantize_base``) and a LoRA fleet trainer's quantized base (``lora_base_plane``,
``stoa.trainer.policy``), whose values equal the int8g64/int4g64 weights plane's bit for bit (``bf16`` storage:
the weights, scales and biases rounded to bf16 as ``stoa.weights.planes.quantize_int8g64`` does; tested)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn


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
        bf16: quantize as the int8g64/int4g64 weights plane does (weights rounded to bf16 first; scales and
            biases stored as bf16; always packed): a fleet trainer's base (``lora_base_plane``).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, bits: int, group_size: int, packed: bool, bf16: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bits, self.group_size, self.packed, self.bf16 = bits, group_size, packed or bf16, bf16
        w = linear.weight.detach()
        codes, scales, biases = quantize_affine(w.to(torch.bfloat16) if bf16 else w, bits, group_size)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        if self.packed:
            self.register_buffer("codes", pack_nibbles(codes) if bits == 4 else codes)
            self.register_buffer("scales", scales.to(torch.bfloat16) if bf16 else scales)
            self.register_buffer("biases", biases.to(torch.bfloat16) if bf16 else biases)
        else:
            self.register_buffer("weight", dequantize_affine(codes, scales, biases))

    def dequantized(self) -> torch.Tensor:
        """The [out, in] weight values (float32; bf16 scales and biases are widened, as the plane's
        ``dequantize_int8g64(compute=True)``)."""
        if not self.packed:
            return self.weight
        codes = unpack_nibbles(self.codes) if self.bits == 4 else self.codes
        return dequantize_affine(codes, self.scales.float(), self.biases.float())

    def plane_bits(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A ``bf16`` linear's values as the weights plane stores them (copies): uint32 codes [out, in * bits / 32]
        (the packed bytes, little end first, are the plane's words), scales and biases as uint16 bf16 bits."""
        if not self.bf16:
            raise ValueError("plane_bits needs a QuantLinear built with bf16=True")
        words = self.codes.cpu().numpy().copy().view("<u4").astype(np.uint32, copy=False)
        return (words, self.scales.cpu().view(torch.int16).numpy().view(np.uint16).copy(),
                self.biases.cpu().view(torch.int16).numpy().view(np.uint16).copy())

    def load_plane_bits(self, words: np.ndarray, scales: np.ndarray, biases: np.ndarray) -> None:
        """Set a ``bf16`` linear from the weights plane's stored bits (``plane_bits``' inverse).

        Args:
            words: uint32 codes [out, in * bits / 32].
            scales: uint16 bf16 bits [out, in / group_size].
            biases: likewise.

        Raises:
            ValueError: a shape differs from this linear's.
        """
        codes = torch.from_numpy(np.ascontiguousarray(words).astype("<u4").view(np.uint8))
        s = torch.from_numpy(np.ascontiguousarray(scales, np.uint16).view(np.int16)).view(torch.bfloat16)
        b = torch.from_numpy(np.ascontiguousarray(biases, np.uint16).view(np.int16)).view(torch.bfloat16)
        if codes.shape != self.codes.shape or s.shape != self.scales.shape or b.shape != self.biases.shape:
            raise ValueError(f"plane bits {tuple(words.shape)} do not fit a {self.out_features}x{self.in_features} "
                             f"{self.bits}-bit linear")
        with torch.no_grad():
            self.codes.copy_(codes)
            self.scales.copy_(s)
            self.biases.copy_(b)

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
                f"group_size={self.group_size}, packed={self.packed}, bf16={self.bf16}")


def quantize_linears(layers: Sequence[nn.Module], *, bits: int, group_size: int, packed: bool, bf16: bool = False,
                     keep: Callable[[str], bool] | None = None) -> int:
    """Replace every ``nn.Linear`` inside ``layers`` whose input dimension is a multiple of ``group_size`` by a
    ``QuantLinear``; returns how many.

    Args:
        layers: the decoder blocks (``stoa.models.lora_torch.decoder_blocks``), modified in place.
        bits: 4 or 8.
        group_size: quantization group size.
        packed: ``QuantLinear``'s storage.
        bf16: ``QuantLinear``'s ``bf16`` (the weights plane's rounding).
        keep: paths inside a block to leave in float (local mode's routers); None quantizes every linear.
    """
    n = 0
    for layer in layers:
        for path, module in list(layer.named_modules()):
            if not isinstance(module, nn.Linear) or module.in_features % group_size or (keep and keep(path)):
                continue
            parent_path, _, leaf = path.rpartition(".")
            parent = layer.get_submodule(parent_path) if parent_path else layer
            setattr(parent, leaf, QuantLinear(module, bits, group_size, packed, bf16))
            n += 1
    return n


def quant_linears(model: nn.Module) -> dict[str, QuantLinear]:
    """The model's quantized linears by module path.

    Args:
        model: a model ``quantize_linears`` changed.
    """
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
