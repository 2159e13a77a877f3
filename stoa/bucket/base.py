"""Bucket protocol, errors, object metadata and key validation shared by every backend."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import xxhash

__all__ = [
    "AccessDenied",
    "Bucket",
    "BucketError",
    "BucketUnreachable",
    "MAX_KEY_BYTES",
    "ObjectExists",
    "ObjectInfo",
    "ObjectNotFound",
    "PreconditionFailed",
    "RESERVED_TOP_SEGMENT",
    "check_listed_key",
    "content_digest",
    "file_digest",
    "validate_key",
    "validate_prefix",
]

# S3 limits keys to 1024 bytes of UTF-8.
MAX_KEY_BYTES = 1024
# Local buckets keep temp and lock files under this top-level directory; no key may start with it.
RESERVED_TOP_SEGMENT = ".stoa"
_DIGEST_CHUNK = 8 << 20


class BucketError(Exception):
    """Base class of every bucket error. Messages never contain secrets."""


class ObjectNotFound(BucketError):
    """The key holds no object."""


class ObjectExists(BucketError):
    """A create-only put found a different object already stored at the key."""


class PreconditionFailed(BucketError):
    """A compare-and-swap lost: the stored object's etag was not the expected one."""


class BucketUnreachable(BucketError):
    """The endpoint stayed unreachable (or kept failing transiently) for the whole retry budget."""


class AccessDenied(BucketError):
    """The store refused the credentials or the operation (HTTP 401/403)."""


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object.

    Attributes:
        key: Key relative to the bucket root.
        size: Size in bytes.
        etag: Store etag when the listing provides one (S3 does, the local backend does not).
    """

    key: str
    size: int
    etag: str | None


@runtime_checkable
class Bucket(Protocol):
    """What rollout workers and the trainer use to talk to each other.

    Every write is atomic: an object is visible whole or not at all.
    """

    url: str

    def put_create(self, key: str, data: bytes) -> None:
        """Create-only put; success if byte-identical content is already there, else ObjectExists."""
        ...

    def put(self, key: str, data: bytes) -> None:
        """Unconditional atomic overwrite."""
        ...

    def get(self, key: str) -> bytes:
        """Whole object; ObjectNotFound if missing."""
        ...

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        """Whole object and its etag."""
        ...

    def get_if_changed(self, key: str, etag: str | None) -> tuple[bytes, str] | None:
        """Conditional GET: None when the stored etag equals ``etag``."""
        ...

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``, clipped to the object like a slice."""
        ...

    def cas(self, key: str, data: bytes, expected_etag: str | None) -> str:
        """Compare-and-swap; ``expected_etag=None`` means the key must not exist. Returns the new etag."""
        ...

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """Objects whose key starts with ``prefix``, sorted by key, keys after ``start_after`` only."""
        ...

    def exists(self, key: str) -> bool:
        """Whether the key holds an object."""
        ...

    def delete(self, key: str) -> None:
        """Delete the object; a missing key is fine."""
        ...

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix``; returns how many were listed and deleted."""
        ...

    def put_file(self, key: str, path: str | os.PathLike[str], *, create_only: bool = True) -> None:
        """Upload a local file (streamed; multipart on S3 when not create-only)."""
        ...

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Download to ``path`` through a temporary file renamed into place."""
        ...


def validate_key(key: str) -> str:
    """Check that ``key`` is a key stoa may write and return it unchanged (strict: for keys we build).

    Deletes accept more (:func:`check_listed_key`): anyone holding write credentials can store a key these
    rules refuse, a listing returns it as it is, and retention must be able to delete it.

    Keys are '/'-separated, non-empty, at most 1024 UTF-8 bytes, with no leading or trailing '/',
    no empty, '.' or '..' segments, no backslashes, no control characters, and may not start with
    the reserved segment ``.stoa``.

    Args:
        key: The key to check.

    Returns:
        The key.

    Raises:
        ValueError: When the key breaks one of the rules; the message names the rule.
    """
    if not isinstance(key, str):
        raise ValueError(f"bucket keys must be str, got {type(key).__name__}")
    if not key:
        raise ValueError("bucket key must be non-empty")
    if key.startswith("/"):
        raise ValueError(f"bucket key {key!r} must not start with '/'")
    if key.endswith("/"):
        raise ValueError(f"bucket key {key!r} must not end with '/'")
    if "\\" in key:
        raise ValueError(f"bucket key {key!r} must not contain backslashes")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        raise ValueError(f"bucket key {key!r} must not contain control characters")
    if len(key.encode("utf-8")) > MAX_KEY_BYTES:
        raise ValueError(f"bucket key is longer than {MAX_KEY_BYTES} UTF-8 bytes")
    segments = key.split("/")
    for seg in segments:
        if seg == "":
            raise ValueError(f"bucket key {key!r} must not contain empty segments ('//')")
        if seg in (".", ".."):
            raise ValueError(f"bucket key {key!r} must not contain '.' or '..' segments")
    if segments[0] == RESERVED_TOP_SEGMENT:
        raise ValueError(
            f"bucket key {key!r} must not start with the reserved segment {RESERVED_TOP_SEGMENT!r}"
        )
    return key


def check_listed_key(key: str) -> str:
    """Check that ``key`` can name an object a listing returned, and return it unchanged (lenient: for
    deleting keys of any origin).

    Any non-empty string is a key here (backslashes, control characters, non-UTF-8 names a local listing
    decodes with ``surrogateescape``, any length) except what could name something outside the bucket's
    root or its objects: a NUL, a leading '/', an empty, '.' or '..' segment (which also rules out a
    trailing '/'), or the reserved first segment. The local bucket deletes by this rule; S3 keys are not
    paths, so the S3 bucket deletes any non-empty key (with a raw request where obstore cannot name it,
    see ``stoa.bucket.s3_raw``).

    Args:
        key: The key to check (untrusted: any string).

    Returns:
        The key.

    Raises:
        ValueError: When the key could name something outside the bucket's objects.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"bucket key {key!r} must be a non-empty str")
    if "\0" in key or key.startswith("/"):
        raise ValueError(f"bucket key {key!r} must not start with '/' or contain NUL")
    segments = key.split("/")
    if any(seg in ("", ".", "..") for seg in segments) or segments[0] == RESERVED_TOP_SEGMENT:
        raise ValueError(f"bucket key {key!r} must not hold an empty, '.', '..' or reserved segment")
    return key


def validate_prefix(prefix: str) -> str:
    """Check a listing prefix and return it unchanged.

    A prefix is a plain string prefix of keys (``"runs/r1/rollouts/v0000004"`` matches
    ``"runs/r1/rollouts/v00000042/w-1"``). It may be empty and may end with '/', otherwise it follows
    the key rules.

    Args:
        prefix: The prefix to check.

    Returns:
        The prefix.

    Raises:
        ValueError: When the prefix could never match a valid key.
    """
    if not isinstance(prefix, str):
        raise ValueError(f"bucket prefixes must be str, got {type(prefix).__name__}")
    if prefix == "":
        return prefix
    body = prefix[:-1] if prefix.endswith("/") else prefix
    if not body:
        raise ValueError("bucket prefix must not be '/'; use '' to list everything")
    validate_key(body)
    return prefix


def content_digest(data: bytes | bytearray | memoryview) -> str:
    """Hex xxh3-128 digest of ``data``.

    Args:
        data: The bytes to hash.

    Returns:
        32 lowercase hex characters.
    """
    return xxhash.xxh3_128_hexdigest(data)


def file_digest(path: str | os.PathLike[str]) -> str:
    """Hex xxh3-128 digest of a file's content, read in chunks.

    Args:
        path: The file to hash.

    Returns:
        32 lowercase hex characters (equal to ``content_digest`` of the file's bytes).
    """
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_DIGEST_CHUNK):
            h.update(chunk)
    return h.hexdigest()
