"""Anchors: full checkpoints of a state as safetensors (bf16 bits as BF16, codes as U32) plus a manifest."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from stoa.layout import ANCHOR_FILE
from stoa.untrusted import MAX_INT, as_object, check_text, field_int, field_text, int_list
from stoa.weights.errors import AnchorError
from stoa.weights.hashing import HASH_PREFIX, state_hash_from_tensor_hashes, tensor_hash
from stoa.weights.planes import State, check_plane
from stoa.weights.strict import load_json, refused_as

SCHEMA = "stoa.weights.anchor/1"
FILE_NAME = ANCHOR_FILE
"""Object name of the weights file inside an anchor's prefix (``stoa.layout.ANCHOR_FILE``)."""
_ST_DTYPES = {np.dtype(np.uint16): "BF16", np.dtype(np.uint32): "U32"}
_NP_DTYPES = {"BF16": np.dtype("<u2"), "U32": np.dtype("<u4")}
_MAX_HEADER = 100 * 1024 * 1024
MAX_MANIFEST_BYTES = 16 << 20
"""Longest manifest parsed (a real one is about 300 bytes per tensor)."""
_MAX_ELEMENTS = 1 << 40
"""Most elements one tensor may declare (2**40 bf16 values are 2 TiB, far above any model)."""


def _file_hash(data: bytes | bytearray | memoryview) -> str:
    return HASH_PREFIX + xxhash.xxh3_128(data).hexdigest()


def encode_anchor(
    state: Mapping[str, np.ndarray], *, run_id: str, version: int, plane: str
) -> tuple[bytes, dict[str, Any]]:
    """Write a state as a safetensors file and build its manifest.

    uint16 tensors (bf16 bits) are stored with dtype ``BF16`` so ``mlx.core.load`` and
    ``safetensors.torch.load`` give bfloat16 arrays directly; uint32 packed codes are ``U32``. Tensors
    are laid out by element size, then name, so every tensor starts aligned; the JSON header is padded
    to 8 bytes with spaces.

    Args:
        state: tensor name -> stored bits (uint16 or uint32).
        run_id: run id recorded in the metadata and manifest.
        version: policy version of this state.
        plane: ``"bf16"`` or ``"int8g64"``.

    Returns:
        (the safetensors bytes, the manifest dict with per-tensor hashes, state hash, size and file hash).
    """
    check_plane(plane)
    for name, arr in state.items():
        if np.dtype(arr.dtype).newbyteorder("=") not in _ST_DTYPES:
            raise ValueError(f"{name}: dtype {arr.dtype} is not stored bits (uint16 or uint32)")
    order = sorted(state, key=lambda n: (-state[n].dtype.itemsize, n))
    hashes = {name: tensor_hash(state[name]) for name in order}
    s_hash = state_hash_from_tensor_hashes(hashes)
    metadata = {
        "format": "pt",
        "stoa.schema": SCHEMA,
        "stoa.run_id": run_id,
        "stoa.version": str(version),
        "stoa.plane": plane,
        "stoa.state_hash": s_hash,
    }
    data = _safetensors_bytes(state, order, metadata)
    manifest: dict[str, Any] = {
        "schema": SCHEMA,
        "run_id": run_id,
        "version": version,
        "plane": plane,
        "state_hash": s_hash,
        "file": FILE_NAME,
        "size": len(data),
        "file_hash": _file_hash(data),
        "tensors": {
            name: {
                "dtype": _ST_DTYPES[state[name].dtype.newbyteorder("=")],
                "shape": list(state[name].shape),
                "hash": hashes[name],
            }
            for name in sorted(state)
        },
    }
    return data, manifest


def _safetensors_bytes(state: Mapping[str, np.ndarray], order: list[str], metadata: dict[str, str]) -> bytes:
    """Lay tensors out as one safetensors file in ``order``, the JSON header padded to 8 bytes with spaces.

    Args:
        state: tensor name -> stored bits (uint16 or uint32, any byte order).
        order: tensor names in file order.
        metadata: the ``__metadata__`` strings.
    """
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    chunks: list[memoryview] = []
    for name in order:
        arr = np.ascontiguousarray(state[name])
        dt = arr.dtype.newbyteorder("=")
        le = arr.astype(dt.newbyteorder("<"), copy=False)
        header[name] = {
            "dtype": _ST_DTYPES[dt],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + le.nbytes],
        }
        chunks.append(le.reshape(-1).data.cast("B"))
        offset += le.nbytes
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-(8 + len(hjson)) % 8)
    return b"".join([struct.pack("<Q", len(hjson)), hjson, *chunks])


def _anchor_error(reason: str, detail: str) -> AnchorError:
    return AnchorError(reason, detail)


def load_manifest(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Parse manifest JSON and check its shape (:func:`check_manifest`); raises only ``AnchorError``.

    Args:
        data: the manifest object's bytes.
    """
    manifest = load_json(data, _anchor_error, "manifest", max_bytes=MAX_MANIFEST_BYTES)
    check_manifest(manifest)
    return manifest


def _check_tensors(tensors: Any) -> None:
    tensors = as_object(tensors, "manifest tensors")
    for name, t in tensors.items():
        check_text(name, "tensor name")
        t = as_object(t, f"tensor {name!r}")
        if not isinstance(t.get("dtype"), str) or t["dtype"] not in _NP_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype is not one of {sorted(_NP_DTYPES)}")
        int_list(t.get("shape"), f"tensor {name!r} shape", hi=_MAX_ELEMENTS)
        field_text(t, "hash", max_len=128)


def check_manifest(
    manifest: Any,
    *,
    run_id: str | None = None,
    version: int | None = None,
    plane: str | None = None,
) -> None:
    """Validate a manifest's shape and, when given, that it is for this run, version and plane.

    Any value is accepted as input (a list, a number, a manifest with wrong field types); everything
    that is not a well-formed manifest raises ``AnchorError("bad_format")``.

    Args:
        manifest: the manifest (parsed JSON).
        run_id: expected run id.
        version: expected version.
        plane: expected plane.
    """
    with refused_as(_anchor_error, "manifest"):
        manifest = as_object(manifest, "manifest")
        if manifest.get("schema") != SCHEMA:
            raise ValueError(f"schema is not {SCHEMA!r}")
        field_text(manifest, "run_id")
        field_int(manifest, "version", hi=MAX_INT)
        field_text(manifest, "plane", max_len=32)
        field_text(manifest, "state_hash", max_len=128)
        field_int(manifest, "size", hi=MAX_INT)
        if "file_hash" in manifest:
            field_text(manifest, "file_hash", max_len=128)
        _check_tensors(manifest.get("tensors"))
    if run_id is not None and manifest["run_id"] != run_id:
        raise AnchorError("wrong_run", f"anchor is for run {manifest['run_id']!r}, not {run_id!r}")
    if plane is not None and manifest["plane"] != plane:
        raise AnchorError("wrong_plane", f"anchor is for plane {manifest['plane']!r}, not {plane!r}")
    if version is not None and manifest["version"] != version:
        raise AnchorError("wrong_version", f"anchor is version {manifest['version']}, expected {version}")


def decode_anchor(
    data: bytes | bytearray | memoryview,
    manifest: Any,
    *,
    run_id: str | None = None,
    plane: str | None = None,
    version: int | None = None,
) -> State:
    """Parse an anchor and verify it against its manifest: size, file hash, tensors, every hash.

    Arrays are zero-copy views when ``data`` is writable (a ``bytearray``), else fresh writable copies.
    Total over its inputs: anything malformed raises ``AnchorError``.

    Args:
        data: the safetensors bytes.
        manifest: the manifest written with it.
        run_id: if given, the run the anchor must belong to.
        plane: if given, the plane it must be in.
        version: if given, the version it must be.
    """
    check_manifest(manifest, run_id=run_id, version=version, plane=plane)
    mv = memoryview(data).cast("B")
    if len(mv) < manifest["size"]:
        raise AnchorError("truncated", f"{len(mv)} bytes, manifest says {manifest['size']}")
    if len(mv) != manifest["size"]:
        raise AnchorError("bad_format", f"{len(mv)} bytes, manifest says {manifest['size']}")
    if "file_hash" in manifest and _file_hash(mv) != manifest["file_hash"]:
        raise AnchorError("hash_mismatch", "file hash differs from the manifest")
    header, base = _st_header(mv, manifest)
    entries = _st_entries(header, manifest["tensors"], len(mv) - base)
    writable = not mv.readonly
    state: State = {}
    hashes: dict[str, str] = {}
    for e in entries:
        arr = np.frombuffer(mv, dtype=e.dtype, count=e.count, offset=base + e.start).reshape(e.shape)
        arr = arr.astype(e.dtype.newbyteorder("="), copy=not writable)
        hashes[e.name] = tensor_hash(arr)
        if hashes[e.name] != manifest["tensors"][e.name]["hash"]:
            raise AnchorError("hash_mismatch", f"{e.name}: tensor hash differs from the manifest")
        state[e.name] = arr
    state = {name: state[name] for name in sorted(state)}
    if state_hash_from_tensor_hashes(hashes) != manifest["state_hash"]:
        raise AnchorError("hash_mismatch", "state hash differs from the manifest")
    return state


@dataclass(frozen=True, order=True)
class _StEntry:
    start: int
    end: int
    name: str
    dtype: np.dtype = field(compare=False)
    shape: tuple[int, ...] = field(compare=False)
    count: int = field(compare=False)


def _st_header(mv: memoryview, manifest: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """The safetensors JSON header (metadata checked against the manifest, then removed) and data start."""
    if len(mv) < 8:
        raise AnchorError("truncated", "no safetensors header")
    (hlen,) = struct.unpack_from("<Q", mv, 0)
    if hlen > _MAX_HEADER or 8 + hlen > len(mv):
        raise AnchorError("bad_format", f"safetensors header length {hlen}")
    header = load_json(mv[8 : 8 + hlen], _anchor_error, "safetensors header", max_bytes=_MAX_HEADER)
    if not isinstance(header, dict):
        raise AnchorError("bad_format", "safetensors header is not an object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise AnchorError("bad_format", "safetensors __metadata__ is not an object")
    for key, want in (
        ("stoa.run_id", manifest["run_id"]),
        ("stoa.version", str(manifest["version"])),
        ("stoa.plane", manifest["plane"]),
        ("stoa.state_hash", manifest["state_hash"]),
    ):
        if meta.get(key) != want:
            got = meta.get(key)
            shown = repr(got)[:80] if isinstance(got, str) else type(got).__name__
            raise AnchorError("bad_format", f"metadata {key}={shown} disagrees with manifest {want!r}")
    return header, 8 + hlen


def _st_entries(header: dict[str, Any], tensors: Mapping[str, Any], data_len: int) -> list[_StEntry]:
    """Header entries checked against the manifest and tiling the data section exactly, by offset."""
    if set(header) != set(tensors):
        diff = sorted(set(header) ^ set(tensors))[:5]
        raise AnchorError("tensor_mismatch", f"file and manifest tensor sets differ (e.g. {diff})")
    entries = []
    for name, h in header.items():
        m = tensors[name]
        try:
            h = as_object(h, f"tensor {name!r}")
            dt = _NP_DTYPES.get(h["dtype"]) if isinstance(h.get("dtype"), str) else None
            if dt is None:
                raise ValueError(f"{name!r}: unknown dtype")
            shape = tuple(int_list(h.get("shape"), f"{name!r} shape", hi=_MAX_ELEMENTS))
            start, end = int_list(h.get("data_offsets"), f"{name!r} data_offsets", max_len=2)
        except ValueError:
            raise AnchorError("bad_format", f"{name}: bad safetensors header entry") from None
        if h["dtype"] != m["dtype"] or list(shape) != list(m["shape"]):
            raise AnchorError(
                "tensor_mismatch", f"{name}: file {h['dtype']}{shape}, manifest {m['dtype']}{m['shape']}"
            )
        count = math.prod(shape)
        if end != start + count * dt.itemsize:
            raise AnchorError("bad_format", f"{name}: data offsets {start}..{end} do not match its shape")
        entries.append(_StEntry(start, end, name, dt, shape, count))
    # Like safetensors itself: tensors tile the data section exactly (no holes, no aliasing).
    entries.sort()
    pos = 0
    for e in entries:
        if e.start != pos:
            raise AnchorError("bad_format", f"{e.name}: data starts at {e.start}, expected {pos}")
        pos = e.end
    if pos != data_len:
        raise AnchorError("bad_format", f"data section is {data_len} bytes, tensors cover {pos}")
    return entries
