"""Listing an S3 bucket: keys in lexicographic order, pages fetched lazily, resumable after a failure.

Two modes: "server" trusts the store to list in order and pages from an offset (S3, R2, MinIO);
"client" reads the whole prefix and sorts it (stores that list out of order, e.g. SeaweedFS).

A key obstore cannot parse (a control character; an empty, '.' or '..' segment) fails obstore's whole listing
page; such a listing is done again with raw ListObjectsV2 requests (``stoa.bucket.s3_raw``), which return every
key exactly, and the prefix is listed that way from then on. The first time, one line says so.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import obstore as obs
from obstore.exceptions import InvalidPathError

from .base import BucketError, ObjectInfo, validate_key, validate_prefix
from .s3_retry import Budget

if TYPE_CHECKING:
    from obstore.store import S3Store

    from .s3_raw import RawS3
    from .s3_retry import S3Failures

log = logging.getLogger(__name__)


class S3Listing:
    """The ``list`` method of :class:`stoa.bucket.s3.S3Bucket` (a mixin; the bucket provides the store)."""

    if TYPE_CHECKING:  # provided by S3Bucket
        url: str
        prefix: str
        _listing: str
        _failures: S3Failures
        _raw: RawS3
        _raw_prefixes: set[str]

        def _store(self, bulk: bool = False) -> S3Store: ...

        def _full(self, key: str) -> str: ...

        def _rel(self, path: str) -> str: ...

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """List objects whose key starts with ``prefix`` (plain string prefix), sorted by key.

        Pages are fetched lazily; a transient failure mid-listing resumes after the last key seen.

        Args:
            prefix: Key prefix ('' for everything).
            start_after: Only keys strictly greater than this.

        Yields:
            ObjectInfo with the store's etag.

        Raises:
            BucketError: In "server" listing mode, if the store lists out of lexicographic order.
        """
        validate_prefix(prefix)
        cut = prefix.rfind("/")
        directory = prefix[:cut] if cut >= 0 else ""
        list_prefix = self._full(directory) if directory else (self.prefix or None)
        if prefix in self._raw_prefixes:
            raw = self._list_raw(prefix, start_after)
            yield from (sorted(raw, key=lambda info: info.key) if self._listing == "client" else raw)
        elif self._listing == "client":
            yield from self._list_client(list_prefix, prefix, start_after)
        else:
            yield from self._list_server(list_prefix, prefix, start_after)

    def _list_client(
        self, list_prefix: str | None, prefix: str, start_after: str | None
    ) -> Iterator[ObjectInfo]:
        def attempt(_: int) -> list[ObjectInfo]:
            out: list[ObjectInfo] = []
            try:
                for chunk in obs.list(self._store(), prefix=list_prefix, chunk_size=1000):
                    for meta in chunk:
                        key = self._rel(meta["path"])
                        if key.startswith(prefix) and (start_after is None or key > start_after):
                            out.append(ObjectInfo(key=key, size=meta["size"], etag=meta["e_tag"]))
            except InvalidPathError as exc:
                self._note_raw(prefix, exc)
                out = list(self._list_raw(prefix, start_after))
            out.sort(key=lambda info: info.key)
            return out

        yield from self._failures.attempts("list", prefix, attempt)

    def _list_server(
        self, list_prefix: str | None, prefix: str, start_after: str | None
    ) -> Iterator[ObjectInfo]:
        # Keys must be > start_after and start with prefix; `position` is the exclusive lower bound.
        position = start_after
        floor = _floor(prefix)
        if floor is not None and (position is None or floor > position):
            position = floor
        budget = Budget()
        while True:
            last_seen: str | None = None
            # obstore normalises paths (e.g. drops a trailing '/'), so send a valid key that is <= position
            # and filter exactly here.
            offset = _safe_offset(position)
            try:
                stream = obs.list(
                    self._store(),
                    prefix=list_prefix,
                    offset=self._full(offset) if offset else None,
                    chunk_size=1000,
                )
                while True:
                    try:
                        chunk = next(stream)
                    except StopIteration:
                        return
                    for meta in chunk:
                        key = self._rel(meta["path"])
                        if last_seen is not None and key <= last_seen:
                            raise BucketError(
                                f"list {self.url}: the store returned {key!r} after {last_seen!r}; it does not "
                                "list in lexicographic order (SeaweedFS does this). Open the bucket with "
                                "listing='client' (env STOA_S3_LISTING=client)."
                            )
                        last_seen = key
                        if position is not None and key <= position:
                            continue
                        position = key
                        if key.startswith(prefix):
                            yield ObjectInfo(key=key, size=meta["size"], etag=meta["e_tag"])
                        elif key > prefix:
                            return
            except BucketError:
                raise
            except InvalidPathError as exc:
                self._note_raw(prefix, exc)
                yield from self._list_raw(prefix, position)
                return
            except Exception as exc:
                self._failures.recover(exc, "list", prefix, budget)

    def _note_raw(self, prefix: str, exc: Exception) -> None:
        """Remember that ``prefix`` holds a key obstore cannot parse; say so once per bucket."""
        if not self._raw_prefixes:
            log.warning("list %s: a key under %.200r is one obstore cannot parse (%s); listing such prefixes "
                        "with raw ListObjectsV2 requests", self.url, prefix, self._failures.short(exc)[:200])
        self._raw_prefixes.add(prefix)

    def _list_raw(self, prefix: str, start_after: str | None) -> Iterator[ObjectInfo]:
        """Keys under ``prefix`` after ``start_after``, exact whatever they hold (raw requests, store order)."""
        full_prefix = self._full(prefix) if prefix else (self.prefix + "/" if self.prefix else None)
        after = self._full(start_after) if start_after else None
        for info in self._raw.list(full_prefix, after):
            key = self._rel(info.key)
            if key.startswith(prefix) and (start_after is None or key > start_after):
                yield ObjectInfo(key=key, size=info.size, etag=info.etag)


def obstore_can_name(key: str) -> bool:
    """Whether obstore names ``key`` exactly in a request and a listing (the keys stoa writes do)."""
    try:
        validate_key(key)
    except ValueError:
        return False
    return True


def _safe_offset(position: str | None) -> str | None:
    """The longest '/'-prefix of ``position`` that is a valid key (a prefix sorts before the string)."""
    while position:
        try:
            validate_key(position)
            return position
        except ValueError:
            cut = position.rfind("/")
            position = position[:cut] if cut > 0 else ""
    return None


def _floor(prefix: str) -> str | None:
    """A start-after value below every key that starts with ``prefix`` (None if there is none).

    Lowering the last character gives the tightest bound; when that would produce '/' or a control
    character the prefix minus its last character (a proper prefix, hence smaller) is used instead.
    """
    if not prefix:
        return None
    lowered = chr(ord(prefix[-1]) - 1)
    if lowered > "/":
        return prefix[:-1] + lowered
    return prefix[:-1].rstrip("/") or None
