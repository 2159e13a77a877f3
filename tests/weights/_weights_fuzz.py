"""Mutators for the weight-plane fuzz tests: raw byte damage and structure-aware JSON damage, re-framed.

Raw damage mostly stops at a digest or a length; re-framing (recomputing the patch digest, the anchor's
manifest size and file hash) lets a mutation reach the JSON readers and frame decoders behind them, as a
writer with bucket access could.
"""

from __future__ import annotations

import copy
import json
import random
import struct
from typing import Any

import numpy as np
import xxhash

from stoa.weights.anchor import encode_anchor
from stoa.weights.hashing import HASH_PREFIX
from stoa.weights.planes import State
from stoa.weights.pulse import _PREFIX, MAGIC, encode_patch

RUN = "run-f"
DEEP = "__deep__"
"""Placeholder a mutation puts in a JSON value; :func:`dumps` replaces it with 5000 nested arrays."""

NASTY: list[Any] = [
    None, True, False, 0, -1, 1, 2**31, 2**32, 2**32 - 1, 2**40, 2**63, 2**64, -(2**63) - 1, 10**30,
    1.5, -0.0, 1e308, float("inf"), float("-inf"), float("nan"), "", "x" * 5000, "\ud800", "1", "<u2", "|u1",
    "BF16", "U32", "O", "V8", "u2,u2", "(2,)u2", [], {}, [1, 2], [-1], [2**63], [0, 2**40], [[1]], {"a": 1},
    ["x"], DEEP, "9" * 5000,
]


def states(seed: int = 0) -> tuple[State, State]:
    """A small (prev, new) pair of stored-bit states: three tensors, a few percent of elements changed."""
    rng = np.random.default_rng(seed)
    prev: State = {
        "a.weight": rng.integers(0, 2**16, (16, 8), dtype=np.uint64).astype(np.uint16),
        "b.weight": rng.integers(0, 2**16, (40,), dtype=np.uint64).astype(np.uint16),
        "c.codes": rng.integers(0, 2**32, (4, 4), dtype=np.uint64).astype(np.uint32),
    }
    new = {k: v.copy() for k, v in prev.items()}
    for v in new.values():
        flat = v.reshape(-1)
        idx = rng.choice(flat.size, max(1, flat.size // 10), replace=False)
        flat[idx] ^= np.array(1, v.dtype)
    return prev, new


def patch(prev: State, new: State) -> bytes:
    return encode_patch(prev, new, run_id=RUN, from_version=4, to_version=5, plane="bf16", threads=1)


def anchor(state: State) -> tuple[bytes, dict[str, Any]]:
    return encode_anchor(state, run_id=RUN, version=5, plane="bf16")


def dumps(value: Any) -> bytes:
    """JSON text of ``value`` with every :data:`DEEP` placeholder replaced by 5000 nested arrays."""
    return json.dumps(value).replace(json.dumps(DEEP), "[" * 5000 + "]" * 5000).encode("utf-8", "surrogatepass")


def split_patch(data: bytes) -> tuple[dict[str, Any], bytes]:
    """(header dict, body bytes) of a valid patch."""
    _, _, _, hlen, blen = _PREFIX.unpack_from(data, 0)
    header = json.loads(data[_PREFIX.size : _PREFIX.size + hlen])
    return header, data[_PREFIX.size + hlen : _PREFIX.size + hlen + blen]


def frame_patch(hbytes: bytes, body: bytes, version: int = 1, flags: int = 0) -> bytes:
    """A patch around any header text and body, with correct lengths and digest."""
    prefix = _PREFIX.pack(MAGIC, version, flags, len(hbytes), len(body))
    h = xxhash.xxh3_128(prefix)
    h.update(hbytes)
    h.update(body)
    return prefix + hbytes + body + h.digest()


def split_anchor(data: bytes) -> tuple[dict[str, Any], bytes]:
    """(safetensors header dict, data section) of a valid anchor file."""
    (hlen,) = struct.unpack_from("<Q", data, 0)
    return json.loads(data[8 : 8 + hlen]), data[8 + hlen :]


def frame_anchor(hbytes: bytes, section: bytes, manifest: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """An anchor file around any header text and data section, and the manifest updated to match its
    size and file hash (so decoding gets past both)."""
    hbytes += b" " * (-(8 + len(hbytes)) % 8)
    data = struct.pack("<Q", len(hbytes)) + hbytes + section
    return data, refit_manifest(data, manifest)


def refit_manifest(data: bytes, manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with size and file hash set to those of ``data``."""
    m = dict(manifest)
    m["size"] = len(data)
    m["file_hash"] = HASH_PREFIX + xxhash.xxh3_128(data).hexdigest()
    return m


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """One raw mutation: bit flips, a byte set, truncation, extension, insertion, deletion or splice."""
    b = bytearray(data)
    op = rng.randrange(7)
    if not b:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
    if op == 0:
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif op == 1:
        b[rng.randrange(len(b))] = rng.choice([0, 0xFF, 0x7F, 0x80, ord("["), ord("{"), ord('"'), ord("9")])
    elif op == 2:
        del b[rng.randrange(len(b)) :]
    elif op == 3:
        b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    elif op == 4:
        i = rng.randrange(len(b))
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    elif op == 5:
        i = rng.randrange(len(b))
        del b[i : i + rng.randint(1, 8)]
    else:
        i, j = sorted(rng.randrange(len(b)) for _ in range(2))
        b[i:j] = b[i:j][::-1]
    return bytes(b)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys/indices) into a JSON value, the root included."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _get(value: Any, path: tuple) -> Any:
    for p in path:
        value = value[p]
    return value


def mutate_json(rng: random.Random, value: Any) -> Any:
    """One structure-aware mutation of a parsed JSON value (a deep copy is returned)."""
    v = copy.deepcopy(value)
    path = rng.choice(_paths(v))
    if not path:
        return rng.choice(NASTY)
    parent, last = _get(v, path[:-1]), path[-1]
    op = rng.randrange(6)
    if op <= 1:
        parent[last] = rng.choice(NASTY)
    elif op == 2 and isinstance(parent, dict):
        del parent[last]
    elif op == 2:
        parent.pop(last)
    elif op == 3 and isinstance(parent, list):
        parent.append(copy.deepcopy(parent[last]))  # duplicate an entry (tensor, dim, offset)
    elif op == 3:
        parent[rng.choice(["x", "__metadata__", "name", "dtype", "shape"])] = rng.choice(NASTY)
    elif op == 4 and isinstance(parent[last], int) and not isinstance(parent[last], bool):
        parent[last] += rng.choice([-1, 1, -(2**32), 2**32, 7])
    elif op == 4 and isinstance(parent[last], str) and parent[last]:
        s = parent[last]
        i = rng.randrange(len(s))
        parent[last] = s[:i] + rng.choice(["0", "f", "\ud800", "", "/", "\x00"]) + s[i + 1 :]
    else:
        parent[last] = copy.deepcopy(_get(v, rng.choice(_paths(v)))) if rng.random() < 0.5 else rng.choice(NASTY)
    return v
