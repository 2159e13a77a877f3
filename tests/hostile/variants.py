"""Crafted variants of a bucket object: each turns the honest bytes of an object into hostile ones.

A variant is a function ``(original, ctx) -> bytes | None``; None means it does not apply to that object
(e.g. ``max_int`` on an object holding no integer). JSON variants work on JSON objects and JSONL chunks,
binary variants on patches, anchors and records; ``unsigned``/``other_key`` only on the signed objects.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

DEPTH = 100_000
"""Nesting of the ``deep`` variant: 100,000 '[' (and as many ']')."""
HUGE_BYTES = 64 << 20
"""Size of the ``huge`` variant: 64 MiB of whitespace (JSON) or zeros (binary) around the honest bytes."""
TOP_INT = 2**63 - 1
BIG_DIGITS = 5000
"""``huge_int`` writes 10**5000: a 5,001-digit literal, past Python's default int-string limit (4,300)."""
CANARY_TOKEN = "stoa-hostile-canary-7f3a"
"""The content of the canary files traversal variants point at; it must never show up in the bucket."""


@dataclass(frozen=True)
class PlantContext:
    """What a variant may need besides the honest bytes.

    Args:
        canary: a directory outside the bucket and cache holding ``secret.jsonl`` (its content names
            ``CANARY_TOKEN``); traversal variants point at it.
        depth: how many directories the planted key lies below the bucket root (``runs/r/x.json``: 2).
        huge_cache: a directory where ``huge`` bodies are kept once and hard-linked from (disk stays modest).
    """

    canary: Path
    depth: int
    huge_cache: Path


Variant = Callable[[bytes, PlantContext], "bytes | None"]


def _json(original: bytes) -> Any:
    return json.loads(original)


def _dump(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True).encode()


def _lines(original: bytes) -> list[Any]:
    """Every JSON value of a JSON object or a JSONL chunk."""
    text = original.decode()
    try:
        return [json.loads(text)]
    except ValueError:
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def _map_jsonl(original: bytes, fn: Callable[[Any], Any]) -> bytes:
    """``fn`` applied to each JSON value, written back as one object or as JSONL."""
    values = _lines(original)
    if len(values) == 1 and not original.strip().count(b"\n"):
        return _dump(fn(values[0]))
    return b"".join(_dump(fn(v)) + b"\n" for v in values)


def _leaves(value: Any, leaf: Callable[[Any], Any], key: Callable[[str], str] = lambda k: k) -> Any:
    if isinstance(value, dict):
        return {key(k): _leaves(v, leaf, key) for k, v in value.items()}
    if isinstance(value, list):
        return [_leaves(v, leaf, key) for v in value]
    return leaf(value)


def _has_int(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_has_int(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_int(v) for v in value)
    return type(value) is int


def deep(original: bytes, ctx: PlantContext) -> bytes:
    """100,000 nested arrays: valid JSON that recurses past any stack."""
    return b"[" * DEPTH + b"]" * DEPTH


def huge(original: bytes, ctx: PlantContext) -> bytes:
    """The honest object after 64 MiB of spaces: still valid JSON, far over any sane cap."""
    return b" " * HUGE_BYTES + original


def huge_binary(original: bytes, ctx: PlantContext) -> bytes:
    """The honest bytes followed by 64 MiB of zeros."""
    return original + bytes(HUGE_BYTES)


def as_list(original: bytes, ctx: PlantContext) -> bytes:
    """The object wrapped in a list (a list where an object belongs)."""
    return _map_jsonl(original, lambda v: [v])


def str_int(original: bytes, ctx: PlantContext) -> bytes | None:
    """Every integer written as a string."""
    if not any(_has_int(v) for v in _lines(original)):
        return None
    return _map_jsonl(original, lambda v: _leaves(v, lambda x: str(x) if type(x) is int else x))


def utf16(original: bytes, ctx: PlantContext) -> bytes:
    """The same text in UTF-16 with its byte-order mark."""
    return original.decode().encode("utf-16")


def bad_utf8(original: bytes, ctx: PlantContext) -> bytes:
    """Invalid UTF-8 (0xff 0xfe) inside the first string."""
    at = original.find(b'"')
    return original[:at + 1] + b"\xff\xfe" + original[at + 1:] if at >= 0 else b"\xff\xfe" + original


def _ints_as(original: bytes, literal: str) -> bytes | None:
    values = _lines(original)
    if not any(_has_int(v) for v in values):
        return None
    marker = "@@hostile-int@@"
    out = _map_jsonl(original, lambda v: _leaves(v, lambda x: marker if type(x) is int else x))
    return out.replace(json.dumps(marker).encode(), literal.encode())


def max_int(original: bytes, ctx: PlantContext) -> bytes | None:
    """Every integer replaced by 2**63-1 (a version, a step, a size...)."""
    return _ints_as(original, str(TOP_INT))


def huge_int(original: bytes, ctx: PlantContext) -> bytes | None:
    """Every integer replaced by the 5,001-digit literal 10**5000."""
    return _ints_as(original, "1" + "0" * BIG_DIGITS)


def traversal(original: bytes, ctx: PlantContext) -> bytes:
    """Every string, and every key naming a file, turned into a ``../`` path that lands on the canary."""
    up = "../" * (ctx.depth + 1) + "canary/"

    def key(k: str) -> str:
        return up + k if "." in k or "/" in k else k

    return _map_jsonl(original, lambda v: _leaves(v, lambda x: up + "secret.jsonl" if isinstance(x, str) else x,
                                                  key))


def absolute(original: bytes, ctx: PlantContext) -> bytes:
    """Every string turned into the absolute path of the canary file."""
    secret = str(ctx.canary / "secret.jsonl")
    return _map_jsonl(original, lambda v: _leaves(v, lambda x: secret if isinstance(x, str) else x))


def garbage(original: bytes, ctx: PlantContext) -> bytes:
    """4 KiB of random bytes."""
    return os.urandom(4096)


def truncated(original: bytes, ctx: PlantContext) -> bytes:
    """The first half of the honest bytes."""
    return original[:len(original) // 2]


def empty(original: bytes, ctx: PlantContext) -> bytes:
    """Zero bytes."""
    return b""


def deep_header(original: bytes, ctx: PlantContext) -> bytes:
    """A safetensors file whose JSON header is 100,000 nested arrays."""
    header = b"[" * DEPTH + b"]" * DEPTH
    return len(header).to_bytes(8, "little") + header


def _other_signer() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from stoa.weights.signing import RunSigner

    return RunSigner(ed25519.Ed25519PrivateKey.generate(), Path("/nonexistent/other.ed25519"))


def contract_unsigned(original: bytes, ctx: PlantContext) -> bytes:
    """The contract with its signature stripped (its key kept)."""
    d = _json(original)
    d.pop("signature", None)
    return _dump(d)


def contract_downgraded(original: bytes, ctx: PlantContext) -> bytes:
    """The contract with key and signature stripped: it claims the run was never signed."""
    d = _json(original)
    d.pop("signature", None)
    d.pop("run_key", None)
    return _dump(d)


def contract_other_key(original: bytes, ctx: PlantContext) -> bytes:
    """The contract re-signed by another key (its run_key replaced too: self-consistent, not the run's)."""
    from stoa.contract import RunContract

    return _other_signer().sign_contract(RunContract.from_json(original)).to_json()


def pointer_unsigned(original: bytes, ctx: PlantContext) -> bytes:
    """The pointer with its signature stripped."""
    d = _json(original)
    d.pop("signature", None)
    return _dump(d)


def pointer_other_key(original: bytes, ctx: PlantContext) -> bytes:
    """The pointer signed by another key."""
    from stoa.weights.pointer import Pointer

    p = Pointer.from_json(original)
    return replace(p, signature=_other_signer().sign(p.signed_bytes())).to_json()


JSON_VARIANTS: dict[str, Variant] = {
    "deep": deep, "huge": huge, "list": as_list, "str_int": str_int, "utf16": utf16, "bad_utf8": bad_utf8,
    "traversal": traversal, "absolute": absolute, "max_int": max_int, "huge_int": huge_int,
}
BINARY_VARIANTS: dict[str, Variant] = {
    "garbage": garbage, "truncated": truncated, "empty": empty, "huge": huge_binary,
}
SAFETENSORS_VARIANTS: dict[str, Variant] = {**BINARY_VARIANTS, "deep": deep_header}
CONTRACT_VARIANTS: dict[str, Variant] = {
    **JSON_VARIANTS, "unsigned": contract_unsigned, "downgraded": contract_downgraded,
    "other_key": contract_other_key,
}
POINTER_VARIANTS: dict[str, Variant] = {
    **JSON_VARIANTS, "unsigned": pointer_unsigned, "other_key": pointer_other_key,
}


_HUGE_LOCK = threading.Lock()


def huge_link(body: bytes, ctx: PlantContext, name: str, dest: Path) -> None:
    """Write ``body`` at ``dest`` through a kept copy named ``name`` (hard-linked), so a 64 MiB variant is
    written to disk once per object type, not once per client; only the newest kept copy stays."""
    ctx.huge_cache.mkdir(parents=True, exist_ok=True)
    kept = ctx.huge_cache / name
    with _HUGE_LOCK:
        if not kept.is_file() or kept.stat().st_size != len(body):
            for old in ctx.huge_cache.iterdir():  # cells still holding one keep their own link
                old.unlink()
            tmp = kept.with_suffix(".tmp")
            tmp.write_bytes(body)
            tmp.replace(kept)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.unlink(missing_ok=True)
        os.link(kept, dest)
