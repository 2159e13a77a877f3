"""Stored-bit planes: exact bf16 rounding and MLX-identical int8 (and, for LoRA bases, int4) group-64 affine
quantization in numpy."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

State = dict[str, np.ndarray]
"""A published weight state: tensor name -> array of stored bits (uint16 bf16 bits, uint32 packed codes)."""

PLANES = ("bf16", "int8g64")
"""The full-weight planes a run's contract may name (``plane``)."""
INT4_PLANE = "int4g64"
"""A LoRA run's 4-bit base plane (``BASE_PLANES``): MLX's affine quantizer with bits 4, group 64, 8 codes per
uint32; never a full-weight plane (training updates smaller than a 4-bit step would be lost)."""
BASE_PLANES = (*PLANES, INT4_PLANE)
"""The planes a LoRA run's base may be published in (the contract's ``plane`` when it has an ``adapter``)."""
QUANT_BITS = {"int8g64": 8, INT4_PLANE: 4}
"""Bits per code of each quantized plane."""
ADAPTER_PLANE = "adapter"
"""The plane of a LoRA run's published adapter versions: the adapter tensors only, as bf16 bits
(``stoa.weights.adapter``); the base is published once in the contract's plane."""
WEIGHT_PLANES = (*BASE_PLANES, ADAPTER_PLANE)
"""Every plane a pointer, anchor or patch may carry."""
GROUP_SIZE = 64
BITS = 8
BF16_NAN = 0x7FC0
"""Canonical quiet NaN written for every NaN input (c10::BFloat16 and MLX both use it)."""

_QUANT_SUFFIXES = (".scales", ".biases")
_CHUNK = 1 << 16


def check_plane(plane: str) -> str:
    """Return ``plane`` if it is a known plane, else raise ``ValueError``.

    Args:
        plane: ``"bf16"``, ``"int8g64"``, ``"int4g64"`` or ``"adapter"`` (stored like bf16).
    """
    if plane not in WEIGHT_PLANES:
        raise ValueError(f"unknown weight plane {plane!r}; expected one of {WEIGHT_PLANES}")
    return plane


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (round to nearest, ties to even) and return the bits as uint16.

    Overflow rounds to +-inf, subnormals are kept (no flush to zero), -0.0 stays -0.0, and every NaN
    becomes the canonical quiet NaN 0x7FC0 (what ``c10::BFloat16`` and MLX produce; see docs/weights.md
    for torch's vectorized CPU kernel, which writes 0xFFFF instead).

    Args:
        x: array of any shape; converted to float32 first.
    """
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    u_all = flat.view(np.uint32)
    out = np.empty(flat.size, np.uint16)
    tmp = np.empty(min(_CHUNK, flat.size), np.uint32)
    # Chunked so the uint32 temporaries stay in cache: 10x faster than whole-array ops on 100M values.
    for start in range(0, flat.size, _CHUNK):
        u = u_all[start : start + _CHUNK]
        t = tmp[: u.size]
        # Adding 0x7FFF plus the lowest kept bit rounds to nearest with ties to even. NaNs (which
        # could carry into the sign bit here) are overwritten below.
        np.right_shift(u, np.uint32(16), out=t)
        np.bitwise_and(t, np.uint32(1), out=t)
        t += np.uint32(0x7FFF)
        t += u
        t >>= np.uint32(16)
        out[start : start + u.size] = t
        f = flat[start : start + _CHUNK]
        nan = np.isnan(f)
        if nan.any():
            out[start : start + u.size][nan] = BF16_NAN
    return out.reshape(np.shape(x))


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bits (uint16) to float32 exactly.

    Args:
        bits: uint16 array of bfloat16 bit patterns.
    """
    if bits.dtype != np.uint16:
        raise TypeError(f"expected uint16 bf16 bits, got {bits.dtype}")
    wide = bits.astype(np.uint32)
    wide <<= np.uint32(16)
    return wide.view(np.float32)


def is_quantized_name(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the int8g64 plane quantizes this tensor.

    The rule mirrors what ``mlx.nn.quantize`` does for Linear, Embedding and SwitchLinear layers: a 2-D
    tensor whose name ends in ``.weight``, or a 3-D stacked-experts tensor ``[experts, out, in]`` (a name
    with an ``experts`` or ``switch_mlp`` part, e.g. transformers' fused ``mlp.experts.gate_up_proj``),
    whose input (last) dimension is a multiple of 64. Norm weights are 1-D, biases do not end in
    ``.weight`` and convolution kernels ``[C, 1, K]`` are not expert tensors, so all of them stay bf16.

    Args:
        name: tensor name, e.g. ``model.layers.0.mlp.up_proj.weight``.
        shape: the tensor's shape.
    """
    if not shape or shape[-1] % GROUP_SIZE != 0 or shape[-1] == 0:
        return False
    if len(shape) == 2:
        return name.endswith(".weight")
    parts = name.split(".")
    return len(shape) == 3 and ("experts" in parts or "switch_mlp" in parts)


def quant_stem(name: str) -> str:
    """The prefix a quantized tensor's ``.scales`` and ``.biases`` hang off.

    ``<p>.weight`` gives ``<p>`` (mlx-lm's layout); a tensor without the ``.weight`` suffix, such as
    transformers' fused ``mlp.experts.gate_up_proj``, keeps its whole name (``mlp.experts.gate_up_proj.scales``).

    Args:
        name: the quantized tensor's name.
    """
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _as_bf16_bits(w: np.ndarray) -> np.ndarray:
    if w.dtype == np.uint16:
        return np.ascontiguousarray(w)
    if w.dtype == np.float32:
        return f32_to_bf16_bits(w)
    raise TypeError(f"expected float32 values or uint16 bf16 bits, got {w.dtype}")


def quantize_int8g64(w: np.ndarray, bits: int = BITS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize a [..., out, in] array exactly like ``mx.quantize(mx.array(w, dtype=bfloat16), 64, bits)``.

    Reproduces MLX's affine quantizer bit for bit: per group of 64 along the input (last) dimension, in
    float32, scale = max((max - min) / (2^bits - 1), 1e-7), signed so that the edge with the larger magnitude maps
    to an integer code exactly (scale = edge / rint(edge / scale), bias = edge) unless that code is 0 (then
    bias = 0); codes = clip(rint((w - bias) / scale), 0, 2^bits - 1), 32 / bits per uint32, little end first;
    scale and bias are rounded to bf16. Leading dimensions are rows, as for MLX: a 3-D experts tensor
    ``[E, out, in]`` gives the ``[E, out, in / 4]`` codes ``QuantizedSwitchLinear`` holds.

    Args:
        w: float32 values (rounded to bf16 first, as MLX would) or uint16 bf16 bits, shape [..., out, in]
            (at least 2-D) with in % 64 == 0. Values must be finite.
        bits: 8 (int8g64) or 4 (int4g64).

    Returns:
        (packed uint32 [..., out, in * bits / 32], scales as bf16 bits uint16 [..., out, in / 64], biases likewise).
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if w.ndim < 2 or w.shape[-1] % GROUP_SIZE != 0 or w.shape[-1] == 0:
        raise ValueError(f"int8g64 needs a [..., out, in] array with in % 64 == 0, got shape {w.shape}")
    lead, in_dim = w.shape[:-1], w.shape[-1]
    stored = _as_bf16_bits(w).reshape(-1, in_dim)
    out_dim = stored.shape[0]
    packed = np.empty((out_dim, in_dim * bits // 32), np.uint32)
    scales = np.empty((out_dim, in_dim // GROUP_SIZE), np.uint16)
    biases = np.empty_like(scales)
    rows = max(1, _CHUNK // in_dim)
    for r in range(0, out_dim, rows):
        p, s, b = _quantize_rows(stored[r : r + rows], bits)
        packed[r : r + rows] = p
        scales[r : r + rows] = s
        biases[r : r + rows] = b
    return packed.reshape(*lead, -1), scales.reshape(*lead, -1), biases.reshape(*lead, -1)


def _quantize_rows(stored: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    out_dim, in_dim = stored.shape
    x = bf16_bits_to_f32(stored).reshape(out_dim, in_dim // GROUP_SIZE, GROUP_SIZE)
    if not np.isfinite(x).all():
        raise ValueError("int8g64 quantization needs finite weights (found inf or NaN)")
    w_max = x.max(axis=-1)
    w_min = x.min(axis=-1)
    n_bins = np.float32((1 << bits) - 1)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
        use_min = np.abs(w_min) > np.abs(w_max)
        scale = np.where(use_min, scale, -scale)
        edge = np.where(use_min, w_min, w_max)
        q0 = np.rint(edge / scale)
        exact = q0 != 0
        scale = np.where(exact, edge / np.where(exact, q0, np.float32(1)), scale)
        bias = np.where(exact, edge, np.float32(0))
        q = x - bias[..., None]
        q /= scale[..., None]
    np.rint(q, out=q)
    # fmax maps NaN (only reachable when max - min overflows float32) to code 0, as MLX's cast does on
    # x86 and arm64.
    np.fmax(q, np.float32(0), out=q)
    np.minimum(q, n_bins, out=q)
    codes = q.astype(np.uint8).reshape(out_dim, in_dim)
    return _pack(codes, bits), f32_to_bf16_bits(scale), f32_to_bf16_bits(bias)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes [rows, in] as uint32 words [rows, in * bits / 32], the first code in the lowest bits."""
    rows, in_dim = codes.shape
    if bits == 8:
        return codes.view("<u4").astype(np.uint32, copy=False).reshape(rows, in_dim // 4)
    per = 32 // bits
    parts = codes.reshape(rows, in_dim // per, per).astype(np.uint32)
    packed = np.zeros((rows, in_dim // per), np.uint32)
    for i in range(per):
        packed |= parts[..., i] << np.uint32(bits * i)
    return packed


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint32 words [..., words] as uint8 codes [rows, words * 32 / bits] (inverse of :func:`_pack`)."""
    words = np.ascontiguousarray(packed).astype("<u4", copy=False)
    if bits == 8:
        return words.view(np.uint8).reshape(-1, words.shape[-1] * 4)
    per = 32 // bits
    flat = words.reshape(-1, words.shape[-1])
    shifts = (np.arange(per, dtype=np.uint32) * np.uint32(bits))[None, None, :]
    codes = (flat[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return codes.astype(np.uint8).reshape(flat.shape[0], -1)


def dequantize_int8g64(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, *,
                       compute: bool = False, bits: int = BITS) -> np.ndarray:
    """Dequantize like ``mx.dequantize(..., group_size=64, bits=bits)`` with bf16 scales, as float32.

    MLX computes ``scale * code`` and then ``+ bias`` each rounded to bf16; the result is those bf16
    values widened to float32. With ``compute`` the values are what MLX's quantized matmul multiplies by
    (``mx.quantized_matmul`` in float32, ``stoa.engines.mlx.quantized``): ``code * scale + bias`` in float32 with
    the scales and biases widened, not rounded again; the torch engine and a LoRA trainer compute with these.
    Leading dimensions (experts) are rows, as in :func:`quantize_int8g64`.

    Args:
        packed: uint32 [..., out, in * bits / 32] codes, 32 / bits per word, little end first.
        scales: uint16 bf16 bits [..., out, in / 64].
        biases: uint16 bf16 bits [..., out, in / 64].
        compute: the quantized matmul's float32 values instead of ``mx.dequantize``'s bf16 ones.
        bits: 8 (int8g64) or 4 (int4g64).
    """
    if packed.dtype != np.uint32 or packed.ndim < 2:
        raise TypeError(f"expected uint32 packed codes [..., out, in * bits / 32], got {packed.dtype} {packed.shape}")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    lead, words = packed.shape[:-1], packed.shape[-1]
    per = 32 // bits
    groups = words * per // GROUP_SIZE
    if scales.shape != (*lead, groups) or biases.shape != (*lead, groups) or words * per % GROUP_SIZE:
        raise ValueError(f"scales/biases shape {scales.shape}/{biases.shape} do not fit codes {packed.shape}")
    codes = _unpack(packed, bits).reshape(-1, groups, GROUP_SIZE).astype(np.float32)
    s = bf16_bits_to_f32(np.ascontiguousarray(scales)).reshape(-1, groups)[..., None]
    b = bf16_bits_to_f32(np.ascontiguousarray(biases)).reshape(-1, groups)[..., None]
    with np.errstate(over="ignore", invalid="ignore"):
        if compute:
            res = codes * s + b
        else:
            prod = bf16_bits_to_f32(f32_to_bf16_bits(codes * s))
            res = bf16_bits_to_f32(f32_to_bf16_bits(prod + b))
    return res.reshape(*lead, groups * GROUP_SIZE)


def state_from_f32(named: Mapping[str, np.ndarray], plane: str) -> State:
    """Build the stored-bit state of a plane from float32 (master) weights.

    bf16 plane: every tensor becomes uint16 bf16 bits (round to nearest even). int8g64 (int4g64) plane: tensors
    selected by :func:`is_quantized_name` become ``<p>.weight`` (uint32 packed codes), ``<p>.scales`` and
    ``<p>.biases`` (bf16 bits), the layout of an mlx-lm quantized checkpoint (a fused experts tensor
    without ``.weight`` keeps its name for the codes: see :func:`quant_stem`); the rest stay bf16 bits.

    Args:
        named: tensor name -> float32 (or any float) array.
        plane: ``"bf16"``, ``"int8g64"`` or ``"int4g64"``.
    """
    check_plane(plane)
    bits = QUANT_BITS.get(plane)
    state: State = {}
    for name, arr in named.items():
        a = np.asarray(arr)
        if bits and name.endswith(_QUANT_SUFFIXES):
            raise ValueError(f"tensor name {name!r} collides with the {plane} scales/biases naming")
        if bits and is_quantized_name(name, a.shape):
            stem = quant_stem(name)
            if stem + ".scales" in state:
                raise ValueError(f"tensors {name!r} and another both quantize to {stem + '.scales'!r}")
            packed, scales, biases = quantize_int8g64(np.asarray(a, dtype=np.float32), bits)
            state[name] = packed
            state[stem + ".scales"] = scales
            state[stem + ".biases"] = biases
        else:
            state[name] = f32_to_bf16_bits(a)
    return state


def state_to_f32(state: Mapping[str, np.ndarray], plane: str, *, compute: bool = False) -> dict[str, np.ndarray]:
    """Decode a stored-bit state back to float32 arrays (dequantizing int8g64 matrices like MLX).

    Args:
        state: stored bits as produced by :func:`state_from_f32` or a patch/anchor.
        plane: ``"bf16"``, ``"int8g64"`` or ``"int4g64"``.
        compute: int8g64 matrices as MLX's quantized matmul computes with them (``code * scale + bias`` in float32,
            :func:`dequantize_int8g64`), not ``mx.dequantize``'s bf16 values: what engines and a LoRA trainer's
            base compute with; the bf16 values are what exports and rebuilt models store.
    """
    check_plane(plane)
    bits = QUANT_BITS.get(plane)
    out: dict[str, np.ndarray] = {}
    for name, arr in state.items():
        if bits and name.endswith(_QUANT_SUFFIXES):
            continue
        if arr.dtype == np.uint16:
            out[name] = bf16_bits_to_f32(arr)
        elif bits and arr.dtype == np.uint32:
            stem = quant_stem(name)
            try:
                scales, biases = state[stem + ".scales"], state[stem + ".biases"]
            except KeyError as e:
                raise ValueError(f"quantized tensor {name!r} has no {e.args[0]!r}") from None
            out[name] = dequantize_int8g64(arr, scales, biases, compute=compute, bits=bits)
        else:
            raise ValueError(f"tensor {name!r} has dtype {arr.dtype}, not stored bits of plane {plane!r}")
    return out
