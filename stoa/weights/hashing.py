"""Content hashes of stored-bit tensors and states (xxh3-128; see docs/weights.md for the choice)."""

from __future__ import annotations

import struct
from collections.abc import Mapping

import numpy as np
import xxhash

HASH_PREFIX = "xxh3-128:"
_STATE_TAG = b"stoa.weights.state/1\0"


def _raw(arr: np.ndarray) -> memoryview:
    a = np.ascontiguousarray(arr)
    if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and np.little_endian is False):
        a = a.astype(a.dtype.newbyteorder("<"))
    return a.reshape(-1).data.cast("B")


def tensor_hash(arr: np.ndarray) -> str:
    """Hash one tensor's dtype, shape and raw little-endian bytes; returns ``"xxh3-128:<32 hex>"``.

    Args:
        arr: any numpy array (non-contiguous arrays are copied first).
    """
    h = xxhash.xxh3_128()
    dt = np.dtype(arr.dtype).newbyteorder("<").str.encode()
    h.update(struct.pack("<I", len(dt)) + dt)
    h.update(struct.pack(f"<I{arr.ndim}Q", arr.ndim, *arr.shape))
    h.update(_raw(arr))
    return HASH_PREFIX + h.hexdigest()


def state_hash_from_tensor_hashes(hashes: Mapping[str, str]) -> str:
    """Combine per-tensor hashes (name -> :func:`tensor_hash`) into the state hash.

    The state hash covers the sorted names and each tensor's hash (so dtype, shape and bytes); it is
    what :func:`state_hash` returns, computed without touching the tensor data again.

    Args:
        hashes: tensor name -> tensor hash string.
    """
    h = xxhash.xxh3_128(_STATE_TAG)
    for name in sorted(hashes):
        n = name.encode()
        d = hashes[name].encode()
        h.update(struct.pack("<I", len(n)) + n + struct.pack("<I", len(d)) + d)
    return HASH_PREFIX + h.hexdigest()


def tensor_hashes(state: Mapping[str, np.ndarray]) -> dict[str, str]:
    """Per-tensor hashes of a state.

    Args:
        state: tensor name -> stored bits.
    """
    return {name: tensor_hash(arr) for name, arr in state.items()}


def state_hash(state: Mapping[str, np.ndarray]) -> str:
    """Hash a whole state: sorted names, and per tensor its dtype, shape and raw bytes.

    Args:
        state: tensor name -> stored bits.
    """
    return state_hash_from_tensor_hashes(tensor_hashes(state))
