"""PULSE patches: exact-bit sparse deltas between two published weight states."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import xxhash
import zstandard

from stoa.weights.errors import PatchError
from stoa.weights.hashing import state_hash_from_tensor_hashes, tensor_hash
from stoa.weights.patch_format import (  # noqa: F401 - re-exported: the container lives in patch_format
    _DIGEST_LEN,
    _MAX_GAP,
    _PREFIX,
    _UINT,
    CODEC,
    FORMAT_VERSION,
    MAGIC,
    SCHEMA,
    PatchInfo,
    _Entry,
    _parse,
    read_patch_header,
)
from stoa.weights.planes import State, check_plane

DEFAULT_LEVEL = 1
"""zstd level 1: as small as level 3 on these payloads and faster (figures in docs/weights.md)."""

_CHUNK = 1 << 18

T = TypeVar("T")
R = TypeVar("R")

_tls = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_tls, "c", None)
    if cache is None:
        cache = _tls.c = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_tls, "d", None)
    if d is None:
        d = _tls.d = zstandard.ZstdDecompressor()
    return d


def _pmap(fn: Callable[[T], R], items: Iterable[T], threads: int) -> list[R]:
    items = list(items)
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=threads) as ex:
        return list(ex.map(fn, items))


def default_threads() -> int:
    """Worker threads for encode/apply: up to 4, never more than the CPUs this process may use."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        n = os.cpu_count() or 1
    return max(1, min(4, n))


def _flat_uint(arr: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(arr).reshape(-1)
    if a.dtype.itemsize not in _UINT:
        raise ValueError(f"unsupported element size {a.dtype.itemsize} for dtype {a.dtype}")
    return a.view(_UINT[a.dtype.itemsize])


def changed_positions(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Flat indices (int64, ascending) where the stored bits of ``a`` and ``b`` differ.

    Compares raw unsigned integers, so NaN payloads and -0.0 vs 0.0 count as changes.

    Args:
        a: old stored bits.
        b: new stored bits, same shape and dtype.
    """
    ua, ub = _flat_uint(a), _flat_uint(b)
    parts = []
    for start in range(0, ua.size, _CHUNK):
        p = np.flatnonzero(ua[start : start + _CHUNK] != ub[start : start + _CHUNK])
        if p.size:
            parts.append(p + start)
    if not parts:
        return np.zeros(0, np.int64)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _shuffle(arr: np.ndarray) -> bytes:
    """Byte-planes of a little-endian array: all first bytes, then all second bytes, ..."""
    w = arr.dtype.itemsize
    return arr.view(np.uint8).reshape(-1, w).T.tobytes()


def _unshuffle(buf: bytes | memoryview, n: int, dtype: np.dtype) -> np.ndarray:
    w = dtype.itemsize
    planes = np.frombuffer(buf, np.uint8, count=n * w).reshape(w, n)
    return np.ascontiguousarray(planes.T).view(dtype).reshape(n)


def _check_same_layout(prev: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray]) -> None:
    if prev.keys() != new.keys():
        missing = sorted(set(prev) ^ set(new))[:5]
        raise ValueError(f"prev and new states have different tensor sets (e.g. {missing})")
    for name in prev:
        a, b = prev[name], new[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"{name}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}; publish an anchor instead")


def encode_patch(
    prev: Mapping[str, np.ndarray],
    new: Mapping[str, np.ndarray],
    *,
    run_id: str,
    from_version: int,
    to_version: int,
    plane: str,
    level: int = DEFAULT_LEVEL,
    threads: int | None = None,
) -> bytes:
    """Encode the patch that turns ``prev`` into ``new`` (byte layout in docs/weights.md).

    For each tensor: the ascending flat positions whose stored bits changed, as uint32 gaps, and the
    XOR of old and new bits at those positions; both byte-shuffled and zstd-compressed. The header
    carries run, versions, plane, the base's state hash, and the result's per-tensor and state hashes;
    a trailing xxh3-128 digest covers every byte.

    Args:
        prev: the state at ``from_version``.
        new: the state at ``to_version``; same names, shapes and dtypes as ``prev``.
        run_id: run id written into the header.
        from_version: version of ``prev``.
        to_version: version of ``new`` (greater than ``from_version``).
        plane: ``"bf16"`` or ``"int8g64"``.
        level: zstd level.
        threads: worker threads (default :func:`default_threads`).
    """
    check_plane(plane)
    if not (0 <= from_version < to_version):
        raise ValueError(f"need 0 <= from_version < to_version, got {from_version} -> {to_version}")
    _check_same_layout(prev, new)
    names = sorted(new)
    results = _pmap(lambda name: _encode_tensor(name, prev[name], new[name], level), names,
                    threads or default_threads())
    entries, frames, offset = [], [], 0
    for name, r in zip(names, results, strict=True):
        entries.append(_entry_json(name, new[name], r, offset))
        frames.append(r.frame)
        offset += len(r.frame)
    header = {
        "schema": SCHEMA,
        "run_id": run_id,
        "from_version": from_version,
        "to_version": to_version,
        "plane": plane,
        "codec": CODEC,
        "level": level,
        "from_state_hash": state_hash_from_tensor_hashes({n: r.old_hash for n, r in zip(names, results, strict=True)}),
        "state_hash": state_hash_from_tensor_hashes({n: r.new_hash for n, r in zip(names, results, strict=True)}),
        "tensors": entries,
    }
    hbytes = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    body = b"".join(frames)
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(hbytes), len(body))
    h = xxhash.xxh3_128(prefix)
    h.update(hbytes)
    h.update(body)
    return b"".join((prefix, hbytes, body, h.digest()))


@dataclass(frozen=True)
class _Encoded:
    """One tensor's part of a patch: hashes before and after, changed elements, compressed frame."""

    old_hash: str
    new_hash: str
    changed: int
    frame: bytes


def _encode_tensor(name: str, a: np.ndarray, b: np.ndarray, level: int) -> _Encoded:
    """Hash both versions of one tensor and compress its changed positions (uint32 gaps) and XOR bits."""
    if a.size > _MAX_GAP:
        raise ValueError(f"{name}: {a.size} elements exceeds the 2**32 - 1 a patch can address")
    h_old, h_new = tensor_hash(a), tensor_hash(b)
    p = changed_positions(a, b)
    if p.size == 0:
        return _Encoded(h_old, h_new, 0, b"")
    ua, ub = _flat_uint(a), _flat_uint(b)
    gaps = np.diff(p, prepend=np.int64(-1))
    gaps -= 1
    xor = np.bitwise_xor(ua[p], ub[p])
    le = xor.dtype.newbyteorder("<")
    payload = _shuffle(gaps.astype("<u4")) + _shuffle(xor.astype(le, copy=False))
    return _Encoded(h_old, h_new, int(p.size), _compressor(level).compress(payload))


def _entry_json(name: str, arr: np.ndarray, r: _Encoded, offset: int) -> dict:
    """The header entry of one tensor (its frame starts at ``offset`` in the body)."""
    return {
        "name": name,
        "dtype": arr.dtype.newbyteorder("<").str if arr.dtype.itemsize > 1 else arr.dtype.str,
        "shape": list(arr.shape),
        "hash": r.new_hash,
        "changed": r.changed,
        "offset": offset,
        "length": len(r.frame),
    }


def _decode_frame(e: _Entry, body: memoryview) -> tuple[np.ndarray, np.ndarray]:
    w = e.dtype.itemsize
    want = e.changed * (4 + w)
    frame = bytes(body[e.offset : e.offset + e.length])
    try:
        # The frame header declares its size; check it before decompressing, which would allocate it.
        declared = zstandard.get_frame_parameters(frame).content_size
        if declared != want:
            raise PatchError("bad_format", f"{e.name}: frame declares {declared} bytes, expected {want}")
        raw = _decompressor().decompress(frame, max_output_size=want)
    except zstandard.ZstdError as err:
        raise PatchError("bad_format", f"{e.name}: {err}") from None
    if len(raw) != want:
        raise PatchError("bad_format", f"{e.name}: frame holds {len(raw)} bytes, expected {want}")
    gaps = _unshuffle(raw, e.changed, np.dtype("<u4"))
    pos = gaps.astype(np.int64)
    pos += 1
    np.cumsum(pos, out=pos)
    pos -= 1
    size = int(np.prod(e.shape, dtype=np.int64))
    if pos[-1] >= size:
        raise PatchError("bad_format", f"{e.name}: position {int(pos[-1])} outside {size} elements")
    mv = memoryview(raw)[e.changed * 4 :]
    xor = _unshuffle(mv, e.changed, np.dtype(_UINT[w]).newbyteorder("<")).astype(_UINT[w], copy=False)
    return pos, xor


def apply_patch(
    state: Mapping[str, np.ndarray],
    patch: bytes | bytearray | memoryview,
    *,
    run_id: str,
    expected_from_version: int,
    plane: str,
    expected_from_hash: str | None = None,
    inplace: bool = False,
    threads: int | None = None,
) -> tuple[State, PatchInfo]:
    """Apply a patch: verify it, scatter the exact new bits, verify every result hash.

    Checks in order: magic and format, length, digest, run, plane, from-version, base hash (when
    ``expected_from_hash`` is given), tensor names/shapes/dtypes, frame contents; then applies and
    compares each tensor's hash and the state hash with the header. Any failure raises
    :class:`PatchError` and leaves ``state`` exactly as it was.

    Args:
        state: the state at ``expected_from_version``.
        patch: the patch bytes.
        run_id: the run this worker follows; a foreign patch raises ``wrong_run``.
        expected_from_version: the version ``state`` is at; anything else raises ``wrong_from_version``.
        plane: the plane this worker follows.
        expected_from_hash: the known state hash of ``state``; compared with the patch's base hash.
        inplace: modify ``state``'s arrays in place (no copy; they must be writable) and return a dict
            holding those same arrays. On failure every array is restored before the error propagates.
        threads: worker threads (default :func:`default_threads`).

    Returns:
        (the new state, the patch's header).
    """
    info, entries, body = _parse(patch)
    _check_applies(info, entries, state, run_id=run_id, plane=plane, from_version=expected_from_version,
                   from_hash=expected_from_hash, inplace=inplace)
    nthreads = threads or default_threads()
    names = [e.name for e in entries]
    decoded = dict(
        zip(
            names,
            _pmap(lambda e: _decode_frame(e, body) if e.changed else None, entries, nthreads),
            strict=True,
        )
    )
    return _scatter_and_verify(state, info, entries, decoded, inplace, nthreads), info


def _check_applies(info: PatchInfo, entries: list[_Entry], state: Mapping[str, np.ndarray], *, run_id: str,
                   plane: str, from_version: int, from_hash: str | None, inplace: bool) -> None:
    """Refuse a patch for another run, plane, base version or base state, or for other tensors.

    Args:
        info: the patch header.
        entries: its tensor entries.
        state: the state it would apply to.
        run_id: the run the caller follows.
        plane: the plane the caller follows.
        from_version: the version ``state`` is at.
        from_hash: the known state hash of ``state`` (None: not compared).
        inplace: whether the caller asked to modify ``state``'s arrays (they must then be writable).
    """
    if info.run_id != run_id:
        raise PatchError("wrong_run", f"patch is for run {info.run_id!r}, not {run_id!r}")
    if info.plane != plane:
        raise PatchError("wrong_plane", f"patch is for plane {info.plane!r}, not {plane!r}")
    if info.from_version != from_version:
        raise PatchError(
            "wrong_from_version",
            f"patch goes {info.from_version} -> {info.to_version}, state is at {from_version}",
        )
    if info.to_version <= info.from_version:
        raise PatchError("bad_format", f"to_version {info.to_version} <= from_version {info.from_version}")
    if from_hash is not None and from_hash != info.from_state_hash:
        raise PatchError("base_mismatch", f"state hash {from_hash} but patch base {info.from_state_hash}")
    names = [e.name for e in entries]
    if set(names) != set(state.keys()):
        diff = sorted(set(names) ^ set(state.keys()))[:5]
        raise PatchError("tensor_mismatch", f"tensor sets differ (e.g. {diff})")
    for e in entries:
        arr = state[e.name]
        if arr.shape != e.shape or arr.dtype.newbyteorder("<") != e.dtype.newbyteorder("<"):
            raise PatchError(
                "tensor_mismatch", f"{e.name}: state {arr.dtype}{arr.shape}, patch {e.dtype}{e.shape}"
            )
        if inplace and e.changed and not (arr.flags.writeable and arr.flags.c_contiguous):
            raise ValueError(f"inplace apply needs writable C-contiguous arrays ({e.name})")


_Decoded = tuple[np.ndarray, np.ndarray] | None
"""A tensor's changed positions and XOR bits, or None when the patch leaves it unchanged."""


def _scatter_and_verify(state: Mapping[str, np.ndarray], info: PatchInfo, entries: list[_Entry],
                        decoded: dict[str, _Decoded], inplace: bool, nthreads: int) -> State:
    """XOR the decoded bits into (copies of) the arrays and compare every hash with the header.

    On any failure with ``inplace``, the XOR is applied again to every tensor it touched (XOR is its own
    inverse), so ``state`` is exactly as before, and the error propagates.
    """
    names = [e.name for e in entries]
    out: State = dict(state) if inplace else {}
    applied: list[str] = []
    lock = threading.Lock()

    def work(e: _Entry) -> str:
        arr = state[e.name]
        if not inplace:
            arr = np.array(arr, copy=True, order="C")
            out[e.name] = arr
        d = decoded[e.name]
        if d is not None:
            pos, xor = d
            flat = arr.reshape(-1).view(_UINT[e.dtype.itemsize])
            flat[pos] ^= xor
            with lock:
                applied.append(e.name)
        return tensor_hash(arr)

    try:
        hashes = dict(zip(names, _pmap(work, entries, nthreads), strict=True))
        bad = [n for n in names if hashes[n] != info.tensor_hashes[n]]
        if bad:
            raise PatchError("hash_mismatch", f"{len(bad)} tensors differ after apply (e.g. {bad[0]})")
        if state_hash_from_tensor_hashes(hashes) != info.state_hash:
            raise PatchError("hash_mismatch", "state hash differs after apply")
    except BaseException:
        if inplace:
            for name in applied:  # XOR is its own inverse: re-applying restores the old bits
                d = decoded[name]
                if d is not None:
                    state[name].reshape(-1).view(_UINT[state[name].dtype.itemsize])[d[0]] ^= d[1]
        raise
    if not inplace:
        out = {name: out[name] for name in state}
    return out
