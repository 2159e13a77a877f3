"""Anchors: full checkpoints of a state as safetensors (bf16 bits as BF16, codes as U32) plus a manifest."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import xxhash

from stoa.weights.errors import AnchorError
from stoa.weights.hashing import HASH_PREFIX, state_hash_from_tensor_hashes, tensor_hash
from stoa.weights.planes import State, check_plane

SCHEMA = "stoa.weights.anchor/1"
FILE_NAME = "model.safetensors"
_ST_DTYPES = {np.dtype(np.uint16): "BF16", np.dtype(np.uint32): "U32"}
_NP_DTYPES = {"BF16": np.dtype("<u2"), "U32": np.dtype("<u4")}
_MAX_HEADER = 100 * 1024 * 1024


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
    header: dict[str, Any] = {
        "__metadata__": {
            "format": "pt",
            "stoa.schema": SCHEMA,
            "stoa.run_id": run_id,
            "stoa.version": str(version),
            "stoa.plane": plane,
            "stoa.state_hash": s_hash,
        }
    }
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
    data = b"".join([struct.pack("<Q", len(hjson)), hjson, *chunks])
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


def check_manifest(
    manifest: Mapping[str, Any],
    *,
    run_id: str | None = None,
    version: int | None = None,
    plane: str | None = None,
) -> None:
    """Validate a manifest's shape and, when given, that it is for this run, version and plane.

    Args:
        manifest: the manifest dict (from JSON).
        run_id: expected run id.
        version: expected version.
        plane: expected plane.
    """
    try:
        if manifest["schema"] != SCHEMA:
            raise AnchorError("bad_format", f"manifest schema {manifest['schema']!r}, expected {SCHEMA!r}")
        for key, typ in (
            ("run_id", str),
            ("version", int),
            ("plane", str),
            ("state_hash", str),
            ("size", int),
        ):
            if not isinstance(manifest[key], typ):
                raise AnchorError("bad_format", f"manifest field {key!r} is not {typ.__name__}")
        tensors = manifest["tensors"]
        if not isinstance(tensors, dict) or not all(
            isinstance(t, dict) and t.get("dtype") in _NP_DTYPES and isinstance(t.get("hash"), str)
            for t in tensors.values()
        ):
            raise AnchorError("bad_format", "manifest tensors malformed")
    except KeyError as e:
        raise AnchorError("bad_format", f"manifest lacks {e.args[0]!r}") from None
    if run_id is not None and manifest["run_id"] != run_id:
        raise AnchorError("wrong_run", f"anchor is for run {manifest['run_id']!r}, not {run_id!r}")
    if plane is not None and manifest["plane"] != plane:
        raise AnchorError("wrong_plane", f"anchor is for plane {manifest['plane']!r}, not {plane!r}")
    if version is not None and manifest["version"] != version:
        raise AnchorError("wrong_version", f"anchor is version {manifest['version']}, expected {version}")


def decode_anchor(
    data: bytes | bytearray | memoryview,
    manifest: Mapping[str, Any],
    *,
    run_id: str | None = None,
    plane: str | None = None,
    version: int | None = None,
) -> State:
    """Parse an anchor and verify it against its manifest: size, file hash, tensors, every hash.

    Arrays are zero-copy views when ``data`` is writable (a ``bytearray``), else fresh writable copies.

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
    if len(mv) < 8:
        raise AnchorError("truncated", "no safetensors header")
    (hlen,) = struct.unpack_from("<Q", mv, 0)
    if hlen > _MAX_HEADER or 8 + hlen > len(mv):
        raise AnchorError("bad_format", f"safetensors header length {hlen}")
    try:
        header = json.loads(bytes(mv[8 : 8 + hlen]))
    except ValueError as e:
        raise AnchorError("bad_format", f"safetensors header: {e}") from None
    meta = header.pop("__metadata__", {}) or {}
    for key, want in (
        ("stoa.run_id", manifest["run_id"]),
        ("stoa.version", str(manifest["version"])),
        ("stoa.plane", manifest["plane"]),
        ("stoa.state_hash", manifest["state_hash"]),
    ):
        if meta.get(key) != want:
            raise AnchorError(
                "bad_format", f"metadata {key}={meta.get(key)!r} disagrees with manifest {want!r}"
            )
    tensors = manifest["tensors"]
    if set(header) != set(tensors):
        diff = sorted(set(header) ^ set(tensors))[:5]
        raise AnchorError("tensor_mismatch", f"file and manifest tensor sets differ (e.g. {diff})")
    base = 8 + hlen
    entries = []
    for name, h in header.items():
        m = tensors[name]
        try:
            dt = _NP_DTYPES[h["dtype"]]
            shape = tuple(int(s) for s in h["shape"])
            start, end = (int(x) for x in h["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise AnchorError("bad_format", f"{name}: bad header entry {h!r}") from None
        if h["dtype"] != m["dtype"] or list(shape) != list(m["shape"]):
            raise AnchorError(
                "tensor_mismatch", f"{name}: file {h['dtype']}{shape}, manifest {m['dtype']}{m['shape']}"
            )
        count = int(np.prod(shape, dtype=np.int64))
        if end != start + count * dt.itemsize:
            raise AnchorError("bad_format", f"{name}: data offsets {start}..{end} do not match its shape")
        entries.append((start, end, name, dt, shape, count))
    # Like safetensors itself: tensors tile the data section exactly (no holes, no aliasing).
    entries.sort()
    pos = 0
    for start, end, name, *_ in entries:
        if start != pos:
            raise AnchorError("bad_format", f"{name}: data starts at {start}, expected {pos}")
        pos = end
    if base + pos != len(mv):
        raise AnchorError("bad_format", f"data section is {len(mv) - base} bytes, tensors cover {pos}")
    writable = not mv.readonly
    state: State = {}
    hashes: dict[str, str] = {}
    for start, _, name, dt, shape, count in entries:
        m = tensors[name]
        arr = np.frombuffer(mv, dtype=dt, count=count, offset=base + start).reshape(shape)
        arr = arr.astype(dt.newbyteorder("="), copy=not writable)
        hashes[name] = tensor_hash(arr)
        if hashes[name] != m["hash"]:
            raise AnchorError("hash_mismatch", f"{name}: tensor hash differs from the manifest")
        state[name] = arr
    state = {name: state[name] for name in sorted(state)}
    if state_hash_from_tensor_hashes(hashes) != manifest["state_hash"]:
        raise AnchorError("hash_mismatch", "state hash differs from the manifest")
    return state
