"""The pointer (``current.json``) that says which weights are current, and listings of anchors and patches.

The keys themselves come from ``stoa.layout``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

from stoa.bucket import Bucket
from stoa.layout import (
    ANCHOR_MANIFEST,
    anchor_prefix,
    anchors_prefix,
    parse_anchor_key,
    parse_patch_key,
    patch_key,
    patches_prefix,
    pointer_key,
    weights_prefix,
)
from stoa.untrusted import check_text, field_int, field_text, load_object
from stoa.weights.anchor import FILE_NAME
from stoa.weights.ed25519 import POINTER_DOMAIN
from stoa.weights.errors import SyncError
from stoa.weights.signing import verify_signature
from stoa.weights.strict import refused_as

POINTER_SCHEMA = "stoa.weights.pointer/1"
MANIFEST_NAME = ANCHOR_MANIFEST

__all__ = [
    "MANIFEST_NAME",
    "POINTER_SCHEMA",
    "Pointer",
    "anchor_prefix",
    "complete",
    "list_anchors",
    "list_patches",
    "now_iso",
    "patch_key",
    "pointer_key",
    "weights_prefix",
]


MAX_POINTER_BYTES = 64 << 10
"""Longest ``current.json`` read (the trainer writes about 400 bytes)."""
MAX_VERSION = (1 << 63) - 1
"""Largest version a pointer may name; nothing is sized by it (a sync walks only the patches listed)."""


def _pointer_error(reason: str, detail: str) -> SyncError:
    return SyncError(reason, detail)


@dataclass(frozen=True)
class Pointer:
    """The content of ``current.json``: which version is current and where its anchor is.

    Args:
        run_id: the run.
        version: the current policy version.
        anchor_version: the newest anchor at or before ``version``.
        plane: weight plane.
        state_hash: state hash of the weights at ``version``.
        updated_at: ISO-8601 UTC time the trainer wrote it.
        schema: pointer schema id.
        signature: the run key's Ed25519 signature over :meth:`signed_bytes` (hex; "" on an unsigned run).
        etag: the bucket etag the pointer was read with (not part of the JSON).
    """

    run_id: str
    version: int
    anchor_version: int
    plane: str
    state_hash: str
    updated_at: str
    schema: str = POINTER_SCHEMA
    signature: str = ""
    etag: str | None = field(default=None, compare=False)

    def to_json(self) -> bytes:
        """Serialize (without the etag; without the signature on an unsigned run)."""
        d = asdict(self)
        d.pop("etag")
        if not self.signature:
            d.pop("signature")
        return json.dumps(d, sort_keys=True, indent=1).encode()

    def signed_bytes(self) -> bytes:
        """What the run key signs: a domain prefix and the canonical JSON of every field but the signature
        (run, version, anchor, plane, state hash, time, schema)."""
        d = asdict(self)
        d.pop("etag")
        d.pop("signature")
        return POINTER_DOMAIN + json.dumps(d, sort_keys=True, separators=(",", ":"),
                                                         ensure_ascii=True).encode()

    def check_signature(self, run_key: str) -> Pointer:
        """``self`` when ``run_key`` ("" = an unsigned run: anything goes) signed it, else ``SyncError``
        ``unsigned``, ``malformed_signature`` or ``bad_signature``.

        Args:
            run_key: the run's public key (hex) as the contract carries it and the client pinned it.
        """
        if run_key:
            verify_signature(run_key, self.signature, self.signed_bytes(), "current.json")
        return self

    @classmethod
    def from_json(cls, data: bytes, etag: str | None = None) -> Pointer:
        """Parse and validate pointer JSON (``stoa.untrusted``: at most 64 KiB, one object deep); any malformed
        input raises ``SyncError("bad_pointer")``.

        Versions are non-negative integers (not bools or floats) with ``anchor_version <= version``;
        every other field is a string; ``signature`` is optional here (checked by the reader against the run's
        key, see ``stoa.weights.signing``).

        Args:
            data: the object content.
            etag: the etag it was read with.
        """
        with refused_as(_pointer_error, "current.json", "bad_pointer"):
            d = load_object(data, "pointer", max_bytes=MAX_POINTER_BYTES, max_depth=1)
            if d.get("schema") != POINTER_SCHEMA:
                raise ValueError(f"schema is not {POINTER_SCHEMA!r}")
            version = field_int(d, "version", hi=MAX_VERSION)
            p = cls(
                run_id=field_text(d, "run_id"),
                version=version,
                anchor_version=field_int(d, "anchor_version", hi=version),
                plane=field_text(d, "plane", max_len=32),
                state_hash=field_text(d, "state_hash", max_len=128),
                updated_at=field_text(d, "updated_at", max_len=64),
                signature=check_text(d["signature"], "signature", max_len=256) if "signature" in d else "",
                etag=etag,
            )
        return p


def now_iso() -> str:
    """The current UTC time as the pointer writes it (ISO-8601, milliseconds)."""
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def list_patches(bucket: Bucket, run_id: str, after: int | None = None) -> dict[int, int]:
    """Patch version -> listed size, for patches above ``after`` (all when None).

    Args:
        bucket: the bucket.
        run_id: the run.
        after: only versions above this.
    """
    start = patch_key(run_id, after) if after is not None else None
    out: dict[int, int] = {}
    for obj in bucket.list(patches_prefix(run_id), start_after=start):
        if (version := parse_patch_key(run_id, obj.key)) is not None:
            out[version] = obj.size
    return out


def list_anchors(bucket: Bucket, run_id: str) -> dict[int, dict[str, int]]:
    """Anchor version -> {object name: listed size}; an anchor is complete when it has both objects.

    Args:
        bucket: the bucket.
        run_id: the run.
    """
    out: dict[int, dict[str, int]] = {}
    for obj in bucket.list(anchors_prefix(run_id)):
        if (parsed := parse_anchor_key(run_id, obj.key)) is not None:
            out.setdefault(parsed.version, {})[parsed.name] = obj.size
    return out


def complete(objs: Mapping[str, int]) -> bool:
    """Whether an anchor's listed objects include both the file and the manifest (written last).

    Args:
        objs: object name -> size, from :func:`list_anchors`.
    """
    return FILE_NAME in objs and MANIFEST_NAME in objs
