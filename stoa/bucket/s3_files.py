"""File transfers on an S3 bucket: streamed uploads (multipart when overwriting), downloads to a temp file.

A create-only upload is one PUT with If-None-Match (S3 caps one PUT at 5 GiB); an overwrite streams
in parts. Downloads land in a temporary file next to the destination, renamed into place.
"""

from __future__ import annotations

import mmap
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import obstore as obs

from .base import ObjectExists, file_digest, validate_key

if TYPE_CHECKING:
    from obstore.store import S3Store

    from .s3_retry import S3Failures

MIB = 1 << 20
MAX_SINGLE_PUT = 5 * 1024 * MIB
"""S3's limit for one PUT; create-only uploads are single PUTs (see put_file)."""
DOWNLOAD_CHUNK = 8 * MIB


class S3Files:
    """``put_file`` and ``get_file`` of :class:`stoa.bucket.s3.S3Bucket` (a mixin; the bucket provides the rest)."""

    if TYPE_CHECKING:  # provided by S3Bucket
        url: str
        _failures: S3Failures
        _part_size: int
        _max_concurrency: int

        def _store(self, bulk: bool = False) -> S3Store: ...

        def _full(self, key: str) -> str: ...

        def _same_content(self, path: str, size: int, digest: Callable[[], str]) -> bool: ...

        def _create(self, op: str, key: str, path: str,
                    body: Callable[[], AbstractContextManager[bytes | mmap.mmap]], size: int,
                    digest: Callable[[], str]) -> None: ...

    def put_file(self, key: str, path: str | os.PathLike[str], *, create_only: bool = True) -> None:
        """Upload a local file atomically.

        ``create_only=False`` streams a multipart upload (``part_size`` parts, ``max_concurrency`` in
        flight; memory stays around part_size x concurrency). ``create_only=True`` needs
        ``If-None-Match``, which obstore only sends on a single PUT, so the file is memory-mapped and
        sent as one PUT (page cache, not heap; S3 caps it at 5 GiB). A HEAD first avoids re-uploading
        a large file that is already there.

        Args:
            key: Object key.
            path: Local file.
            create_only: Fail with ObjectExists if a different object is there (identical is success).

        Raises:
            ObjectExists: create_only and a different object is stored at ``key``.
            ValueError: create_only and the file is larger than 5 GiB.
        """
        validate_key(key)
        src = Path(path)
        size = os.stat(src).st_size
        full = self._full(key)
        if create_only:
            if size > MAX_SINGLE_PUT:
                raise ValueError(
                    f"put_file create_only is one PUT and S3 caps a PUT at 5 GiB ({src} is {size} bytes); "
                    "use create_only=False (multipart) for larger files"
                )
            self._put_file_create(key, full, src, size)
            return

        def attempt(_: int) -> None:
            if size <= self._part_size:
                obs.put(self._store(), full, src.read_bytes(), mode="overwrite", use_multipart=False)
            else:
                obs.put(
                    self._store(bulk=True),
                    full,
                    src,
                    use_multipart=True,
                    chunk_size=self._part_size,
                    max_concurrency=self._max_concurrency,
                )

        self._failures.attempts("put_file", key, attempt)

    def _put_file_create(self, key: str, full: str, src: Path, size: int) -> None:
        digest_cache: list[str] = []

        def digest() -> str:
            if not digest_cache:
                digest_cache.append(file_digest(src))
            return digest_cache[0]

        def precheck(_: int) -> bool:
            try:
                same = self._same_content(full, size, digest)
            except FileNotFoundError:
                return False
            if not same:
                raise ObjectExists(f"put_file {self.url} key {key!r}: a different object exists")
            return True

        if self._failures.attempts("put_file", key, precheck):
            return

        @contextmanager
        def body() -> Iterator[bytes | mmap.mmap]:
            if size == 0:
                yield b""
                return
            with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                yield m

        self._create("put_file", key, full, body, size, digest)

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Stream an object to ``path`` through a temp file next to it, renamed into place.

        Args:
            key: Object key.
            path: Destination file; its directory must exist.

        Raises:
            ObjectNotFound: Nothing is stored at ``key``.
        """
        validate_key(key)
        full = self._full(key)
        dest = Path(path)
        part = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:12]}.part")
        out = open(part, "wb")
        try:

            def attempt(_: int) -> None:
                out.seek(0)
                out.truncate()
                result = obs.get(self._store(bulk=True), full)
                for chunk in result.stream(min_chunk_size=DOWNLOAD_CHUNK):
                    out.write(chunk)

            self._failures.attempts("get_file", key, attempt)
            out.flush()
            os.fsync(out.fileno())
            out.close()
            os.replace(part, dest)
        except BaseException:
            out.close()
            try:
                os.unlink(part)
            except FileNotFoundError:
                pass
            raise
