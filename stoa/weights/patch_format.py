"""The PULSE patch container: framing, digest and a strictly typed JSON header (layout in docs/weights.md).

Reading a patch is a total function over arbitrary bytes: anything malformed is a ``PatchError``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from stoa.untrusted import MAX_INT, as_object, element_count, field_int, field_text, int_list
from stoa.weights.errors import PatchError
from stoa.weights.hashing import state_hash_from_tensor_hashes
from stoa.weights.strict import load_json, refused_as

MAGIC = b"STOAPTCH"
FORMAT_VERSION = 1
SCHEMA = "stoa.weights.patch/1"
CODEC = "xor-shuffle-zstd"

_PREFIX = struct.Struct("<8sHHIQ")  # magic, format version, flags, header length, body length
_DIGEST_LEN = 16
_MAX_GAP = (1 << 32) - 1
MAX_HEADER_BYTES = 256 << 20
"""Longest patch header read (about 300 bytes per tensor; the header length field allows 4 GiB)."""
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True)
class PatchInfo:
    """What a patch says about itself (read from its verified header).

    Args:
        run_id: run the patch belongs to.
        from_version: version the patch applies to.
        to_version: version it produces.
        plane: weight plane (``bf16`` or ``int8g64``).
        from_state_hash: state hash of the base it was made against.
        state_hash: state hash of the result.
        tensor_hashes: per-tensor hashes of the result.
        changed: number of elements whose stored bits change.
        elements: total number of elements in the state.
        nbytes: size of the patch in bytes.
        level: zstd level used.
    """

    run_id: str
    from_version: int
    to_version: int
    plane: str
    from_state_hash: str
    state_hash: str
    tensor_hashes: dict[str, str] = field(repr=False)
    changed: int
    elements: int
    nbytes: int
    level: int


@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    hash: str
    changed: int
    offset: int
    length: int


_DTYPES = {
    d.str: d
    for d in (np.dtype(c).newbyteorder("<")
              for c in ("b1", "i1", "u1", "i2", "u2", "f2", "i4", "u4", "f4", "i8", "u8", "f8", "c8"))
}
"""Patch dtypes by their header string: plain little-endian numbers whose element size a patch can XOR."""


def _patch_error(reason: str, detail: str) -> PatchError:
    return PatchError(reason, detail)


def _entry(t: Any, blen: int) -> tuple[_Entry, int]:
    """One header tensor entry, strictly typed; returns it and its element count."""
    t = as_object(t, "tensor entry")
    name = field_text(t, "name")
    dtype = _DTYPES.get(field_text(t, "dtype", max_len=8))
    if dtype is None:
        raise ValueError(f"{name!r}: unknown dtype")
    shape = tuple(int_list(t.get("shape"), f"{name!r} shape", hi=_MAX_GAP))
    size = element_count(list(shape), name, hi=_MAX_GAP)
    e = _Entry(
        name,
        dtype,
        shape,
        field_text(t, "hash", max_len=128),
        field_int(t, "changed", hi=size),
        field_int(t, "offset", hi=blen),
        field_int(t, "length", hi=blen),
    )
    if e.offset + e.length > blen or (e.changed == 0) != (e.length == 0):
        raise ValueError(f"tensor {name!r} frame out of bounds")
    return e, size


def _header(hbytes: memoryview, blen: int, n: int) -> tuple[PatchInfo, list[_Entry]]:
    """Parse and type-check the JSON header; every malformation is ``PatchError("bad_format")``."""
    header = load_json(hbytes, _patch_error, "patch header", max_bytes=MAX_HEADER_BYTES)
    with refused_as(_patch_error, "header"):
        header = as_object(header, "patch header")
        if header.get("schema") != SCHEMA or header.get("codec") != CODEC:
            raise ValueError(f"unknown schema or codec; this reader knows {SCHEMA} {CODEC}")
        tensors = header.get("tensors")
        if not isinstance(tensors, list):
            raise ValueError("tensors is not a list")
        entries, elements, changed = [], 0, 0
        for t in tensors:
            e, size = _entry(t, blen)
            entries.append(e)
            elements += size
            changed += e.changed
        info = PatchInfo(
            run_id=field_text(header, "run_id"),
            from_version=field_int(header, "from_version", hi=MAX_INT),
            to_version=field_int(header, "to_version", hi=MAX_INT),
            plane=field_text(header, "plane", max_len=32),
            from_state_hash=field_text(header, "from_state_hash", max_len=128),
            state_hash=field_text(header, "state_hash", max_len=128),
            tensor_hashes={e.name: e.hash for e in entries},
            changed=changed,
            elements=elements,
            nbytes=n,
            level=field_int(header, "level", lo=-(1 << 31), hi=1 << 31),
        )
    return info, entries


def _parse(patch: bytes | bytearray | memoryview) -> tuple[PatchInfo, list[_Entry], memoryview]:
    mv = memoryview(patch).cast("B")
    n = len(mv)
    if n < len(MAGIC):
        raise PatchError("truncated" if MAGIC.startswith(bytes(mv)) else "bad_magic", f"{n} bytes")
    if bytes(mv[: len(MAGIC)]) != MAGIC:
        raise PatchError("bad_magic", f"starts with {bytes(mv[:8])!r}")
    if n < _PREFIX.size:
        raise PatchError("truncated", f"{n} bytes, prefix needs {_PREFIX.size}")
    _, version, flags, hlen, blen = _PREFIX.unpack_from(mv, 0)
    if version != FORMAT_VERSION or flags != 0:
        raise PatchError(
            "bad_format", f"format version {version} flags {flags}; this reader knows {FORMAT_VERSION}"
        )
    total = _PREFIX.size + hlen + blen + _DIGEST_LEN
    if n < total:
        raise PatchError("truncated", f"{n} bytes, header says {total}")
    if n > total:
        raise PatchError("bad_format", f"{n - total} trailing bytes")
    h = xxhash.xxh3_128()
    h.update(mv[: total - _DIGEST_LEN])
    if h.digest() != bytes(mv[total - _DIGEST_LEN :]):
        raise PatchError("checksum", "patch digest does not match its bytes")
    info, entries = _header(mv[_PREFIX.size : _PREFIX.size + hlen], blen, n)
    if len(info.tensor_hashes) != len(entries):
        raise PatchError("bad_format", "duplicate tensor names")
    if state_hash_from_tensor_hashes(info.tensor_hashes) != info.state_hash:
        raise PatchError("bad_format", "state hash does not match the per-tensor hashes")
    body = mv[_PREFIX.size + hlen : _PREFIX.size + hlen + blen]
    return info, entries, body


def read_patch_header(patch: bytes | bytearray | memoryview) -> PatchInfo:
    """Verify a patch's framing and digest and return its header, without applying it.

    Args:
        patch: the patch bytes.
    """
    return _parse(patch)[0]
