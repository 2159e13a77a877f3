"""Where a run's weights live in the bucket, and the pointer (``current.json``) that says which is current."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

from stoa.bucket import Bucket
from stoa.weights import strict
from stoa.weights.anchor import FILE_NAME
from stoa.weights.errors import SyncError

POINTER_SCHEMA = "stoa.weights.pointer/1"
MANIFEST_NAME = "manifest.json"


def weights_prefix(run_id: str) -> str:
    """Key prefix of a run's weight plane, ``runs/<run>/weights/``.

    Args:
        run_id: the run id.
    """
    return f"runs/{run_id}/weights/"


def pointer_key(run_id: str) -> str:
    """Key of the pointer object.

    Args:
        run_id: the run id.
    """
    return weights_prefix(run_id) + "current.json"


def patch_key(run_id: str, version: int) -> str:
    """Key of the patch from ``version - 1`` to ``version``.

    Args:
        run_id: the run id.
        version: the version the patch produces.
    """
    return weights_prefix(run_id) + f"versions/v{version:08d}.patch"


def anchor_prefix(run_id: str, version: int) -> str:
    """Key prefix of the anchor at ``version`` (holds model.safetensors and manifest.json).

    Args:
        run_id: the run id.
        version: the anchor's version.
    """
    return weights_prefix(run_id) + f"anchors/v{version:08d}/"


def _pointer_error(reason: str, detail: str) -> SyncError:
    return SyncError("bad_pointer", f"current.json: {detail}")


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
        etag: the bucket etag the pointer was read with (not part of the JSON).
    """

    run_id: str
    version: int
    anchor_version: int
    plane: str
    state_hash: str
    updated_at: str
    schema: str = POINTER_SCHEMA
    etag: str | None = field(default=None, compare=False)

    def to_json(self) -> bytes:
        """Serialize (without the etag)."""
        d = asdict(self)
        d.pop("etag")
        return json.dumps(d, sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, etag: str | None = None) -> Pointer:
        """Parse and validate pointer JSON; any malformed input raises ``SyncError("bad_pointer")``.

        Versions are non-negative integers (not bools or floats) with ``anchor_version <= version``;
        every other field is a string.

        Args:
            data: the object content.
            etag: the etag it was read with.
        """
        d = strict.load_json(data, _pointer_error, "current.json")
        try:
            d = strict.obj(d, "pointer")
            if d.get("schema") != POINTER_SCHEMA:
                raise strict.FieldError(f"schema is not {POINTER_SCHEMA!r}")
            version = strict.integer(d, "version")
            p = cls(
                run_id=strict.text(d, "run_id"),
                version=version,
                anchor_version=strict.integer(d, "anchor_version", hi=version),
                plane=strict.text(d, "plane", max_len=32),
                state_hash=strict.text(d, "state_hash", max_len=128),
                updated_at=strict.text(d, "updated_at", max_len=64),
                etag=etag,
            )
        except strict.FieldError as e:
            raise SyncError("bad_pointer", f"current.json: {e}") from None
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
    prefix = weights_prefix(run_id) + "versions/"
    start = patch_key(run_id, after) if after is not None else None
    out: dict[int, int] = {}
    for obj in bucket.list(prefix, start_after=start):
        name = obj.key[len(prefix) :]
        m = re.fullmatch(r"v(\d{8})\.patch", name)
        if m:
            out[int(m.group(1))] = obj.size
    return out


def list_anchors(bucket: Bucket, run_id: str) -> dict[int, dict[str, int]]:
    """Anchor version -> {object name: listed size}; an anchor is complete when it has both objects.

    Args:
        bucket: the bucket.
        run_id: the run.
    """
    prefix = weights_prefix(run_id) + "anchors/"
    out: dict[int, dict[str, int]] = {}
    for obj in bucket.list(prefix):
        parts = obj.key[len(prefix) :].split("/")
        if len(parts) == 2 and (m := re.fullmatch(r"v(\d{8})", parts[0])):
            out.setdefault(int(m.group(1)), {})[parts[1]] = obj.size
    return out


def complete(objs: Mapping[str, int]) -> bool:
    """Whether an anchor's listed objects include both the file and the manifest (written last).

    Args:
        objs: object name -> size, from :func:`list_anchors`.
    """
    return FILE_NAME in objs and MANIFEST_NAME in objs
