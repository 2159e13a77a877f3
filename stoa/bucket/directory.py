"""Bucket on a local (or shared POSIX) directory: atomic create via link, CAS under flock."""

from __future__ import annotations

import fcntl
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import xxhash

from .base import (
    RESERVED_TOP_SEGMENT,
    BucketError,
    ObjectExists,
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    check_listed_key,
    content_digest,
    file_digest,
    validate_key,
    validate_prefix,
)
from .meter import extra, metered
from .outage import RetryPolicy, map_os_errors

__all__ = ["LocalBucket"]

_T = TypeVar("_T")
_COPY_CHUNK = 16 << 20
_LOCK_STRIPES = 256
# Temp files older than this are left-overs of killed writers and are removed when a bucket opens.
_STALE_TMP_S = 24 * 3600.0
# How often a write retries when a concurrent delete pruned the parent directory under it.
_PLACE_ATTEMPTS = 8


@metered
@map_os_errors
class LocalBucket:
    """A bucket rooted at a directory.

    Layout: the object for key ``a/b/c`` is the file ``ROOT/a/b/c``. Temp files live in
    ``ROOT/.stoa/tmp`` and lock files in ``ROOT/.stoa/locks``; listing never shows them. The etag of
    an object is the hex xxh3-128 of its content. Because keys are paths, one local bucket cannot
    hold both ``a`` and ``a/b`` (S3 can); such a write raises BucketError. A directory that stops
    working (unmounted share, EIO, full or read-only) raises BucketUnreachable, retried first under
    ``retry`` when one is given; a permission error raises AccessDenied.
    """

    def __init__(self, root: str | os.PathLike[str], *, retry: RetryPolicy | None = None) -> None:
        """Open (and create if missing) a local bucket.

        Args:
            root: The directory holding the objects.
            retry: Retry an unusable directory within this policy's budget (default: fail at once).
        """
        self.retry = retry
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self._meta = self.root / RESERVED_TOP_SEGMENT
        self._tmp = self._meta / "tmp"
        self._locks = self._meta / "locks"
        self._tmp.mkdir(parents=True, exist_ok=True)
        self._locks.mkdir(parents=True, exist_ok=True)
        self.url = self.root.as_uri()
        self._sweep_stale_tmp()

    def __repr__(self) -> str:
        return f"LocalBucket({self.url!r})"

    # ------------------------------------------------------------------ helpers

    def _path(self, key: str) -> Path:
        """Path of a key stoa writes (strict rules)."""
        return self.root / validate_key(key)

    def _found(self, key: str) -> Path:
        """Path of a key to delete: any key a listing returns (never outside the root)."""
        return self.root / check_listed_key(key)

    def _sweep_stale_tmp(self) -> None:
        cutoff = time.time() - _STALE_TMP_S
        try:
            entries = list(os.scandir(self._tmp))
        except FileNotFoundError:
            return
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                    os.unlink(entry.path)
            except OSError:
                pass

    def _new_tmp(self) -> Path:
        return self._tmp / f"{uuid.uuid4().hex}.part"

    def _write_tmp(self, writer: Callable[[int], None]) -> Path:
        """Create a fresh temp file, let ``writer`` fill the fd, fsync, and return the path."""
        tmp = self._new_tmp()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            writer(fd)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quiet(tmp)
            raise
        os.close(fd)
        return tmp

    def _tmp_from_bytes(self, data: bytes) -> Path:
        def write(fd: int) -> None:
            view = memoryview(data)
            while view:
                n = os.write(fd, view[:_COPY_CHUNK])
                view = view[n:]

        return self._write_tmp(write)

    def _tmp_from_file(self, src: str | os.PathLike[str]) -> Path:
        def write(fd: int) -> None:
            with open(src, "rb") as f, os.fdopen(os.dup(fd), "wb") as out:
                shutil.copyfileobj(f, out, _COPY_CHUNK)

        return self._write_tmp(write)

    def _conflict(self, key: str) -> BucketError:
        return BucketError(
            f"key {key!r} conflicts with an existing key in local bucket {self.url} "
            "(a local bucket cannot hold both 'a' and 'a/...')"
        )

    def _place(self, key: str, action: Callable[[Path], _T]) -> _T:
        """Run ``action(final_path)`` after creating parent dirs, retrying if a delete prunes them."""
        final = self._path(key)
        for attempt in range(_PLACE_ATTEMPTS):
            try:
                final.parent.mkdir(parents=True, exist_ok=True)
            except (FileExistsError, NotADirectoryError):
                raise self._conflict(key) from None
            try:
                return action(final)
            except FileNotFoundError:
                if attempt == _PLACE_ATTEMPTS - 1:
                    raise
            except (IsADirectoryError, NotADirectoryError):
                raise self._conflict(key) from None
        raise AssertionError("unreachable")

    def _fsync_dir(self, path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def _link_create(self, key: str, tmp: Path, digest: Callable[[], str]) -> bool:
        """Link ``tmp`` to the key's path. True if created, False if identical content was there.

        Raises ObjectExists when different content is stored at the key.
        """

        def link(final: Path) -> bool:
            try:
                os.link(tmp, final)
            except FileExistsError:
                if final.is_dir():
                    raise self._conflict(key) from None
                extra(self, "HeadObject")  # S3Bucket reads what a create found, to compare
                extra(self, "GetObject")
                try:
                    existing = file_digest(final)
                except FileNotFoundError:
                    # Deleted between our link attempt and the read: try again.
                    return link(final)
                if existing == digest():
                    return False
                raise ObjectExists(f"{self.url}: key {key!r} already holds a different object") from None
            self._fsync_dir(final.parent)
            return True

        return self._place(key, link)

    def _replace(self, key: str, tmp: Path) -> None:
        def replace(final: Path) -> None:
            os.replace(tmp, final)
            self._fsync_dir(final.parent)

        self._place(key, replace)

    @contextmanager
    def _key_lock(self, key: str) -> Iterator[None]:
        stripe = xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogateescape")) % _LOCK_STRIPES
        fd = os.open(self._locks / f"{stripe:03d}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _read(self, key: str) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(f"{self.url}: no object at key {key!r}") from None

    def _current_etag(self, key: str) -> str | None:
        path = self._path(key)
        try:
            return file_digest(path)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def _prune_empty_dirs(self, start: Path) -> None:
        d = start
        while d != self.root and self.root in d.parents:
            try:
                os.rmdir(d)
            except OSError:
                return
            d = d.parent

    # --------------------------------------------------------------- protocol

    def put_create(self, key: str, data: bytes) -> None:
        """Create-only atomic put.

        Args:
            key: Object key.
            data: Object content.

        Raises:
            ObjectExists: A different object is stored at ``key`` (identical content is success).
        """
        validate_key(key)
        tmp = self._tmp_from_bytes(data)
        try:
            self._link_create(key, tmp, lambda: content_digest(data))
        finally:
            _unlink_quiet(tmp)

    def put(self, key: str, data: bytes) -> None:
        """Unconditional atomic overwrite.

        Args:
            key: Object key.
            data: Object content.
        """
        validate_key(key)
        tmp = self._tmp_from_bytes(data)
        try:
            with self._key_lock(key):
                self._replace(key, tmp)
        finally:
            _unlink_quiet(tmp)

    def get(self, key: str) -> bytes:
        """Read a whole object.

        Args:
            key: Object key.

        Returns:
            The content.

        Raises:
            ObjectNotFound: Nothing is stored at ``key``.
        """
        return self._read(key)

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        """Read a whole object and its etag.

        Args:
            key: Object key.

        Returns:
            (content, etag).

        Raises:
            ObjectNotFound: Nothing is stored at ``key``.
        """
        data = self._read(key)
        return data, content_digest(data)

    def get_if_changed(self, key: str, etag: str | None) -> tuple[bytes, str] | None:
        """Read the object unless its etag equals ``etag``.

        Args:
            key: Object key.
            etag: The etag the caller already holds, or None to always read.

        Returns:
            (content, etag), or None when unchanged.

        Raises:
            ObjectNotFound: Nothing is stored at ``key``.
        """
        data, current = self.get_with_etag(key)
        if etag is not None and current == etag:
            return None
        return data, current

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Read bytes ``[start, end)``; like slicing, a range past the end is clipped.

        Args:
            key: Object key.
            start: First byte offset (>= 0).
            end: End offset, exclusive (>= start).

        Returns:
            The bytes.

        Raises:
            ValueError: Negative or inverted range.
            ObjectNotFound: Nothing is stored at ``key``.
        """
        _check_range(start, end)
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                return f.read(end - start)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(f"{self.url}: no object at key {key!r}") from None

    def cas(self, key: str, data: bytes, expected_etag: str | None) -> str:
        """Compare-and-swap under a per-key lock.

        Args:
            key: Object key.
            data: New content.
            expected_etag: The etag that must be stored now, or None if the key must not exist.

        Returns:
            The new etag.

        Raises:
            PreconditionFailed: The stored etag is not ``expected_etag``.
        """
        validate_key(key)
        new_etag = content_digest(data)
        tmp = self._tmp_from_bytes(data)
        try:
            with self._key_lock(key):
                current = self._current_etag(key)
                if current != expected_etag:
                    raise PreconditionFailed(
                        f"{self.url}: cas on {key!r} expected etag {expected_etag!r}, found {current!r}"
                    )
                if expected_etag is None:
                    # Link, not replace: put_create does not take the lock.
                    try:
                        created = self._link_create(key, tmp, lambda: new_etag)
                    except ObjectExists:
                        created = False
                    if not created:
                        raise PreconditionFailed(f"{self.url}: cas on {key!r} expected no object, found one")
                else:
                    self._replace(key, tmp)
        finally:
            _unlink_quiet(tmp)
        return new_etag

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """List objects whose key starts with ``prefix``, sorted by key.

        The walk is lazy and visits directories in key order, so it stops as soon as it passes the
        prefix and skips whole directories before ``start_after``.

        Args:
            prefix: Plain string prefix of keys ('' for everything).
            start_after: Only keys strictly greater than this.

        Yields:
            ObjectInfo with ``etag=None``.
        """
        validate_prefix(prefix)
        cut = prefix.rfind("/")
        base_rel = prefix[: cut + 1]  # "" or "dir/.../"
        name_prefix = prefix[cut + 1 :]
        base_dir = self.root / base_rel if base_rel else self.root
        yield from self._walk(base_dir, base_rel, name_prefix, start_after)

    def _walk(
        self, directory: Path, rel: str, name_prefix: str, start_after: str | None
    ) -> Iterator[ObjectInfo]:
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return
        items: list[tuple[str, os.DirEntry[str], bool]] = []
        for entry in entries:
            name = entry.name
            if not name.startswith(name_prefix):
                continue
            if not rel and name == RESERVED_TOP_SEGMENT:
                continue
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                continue
            # A directory's keys all start with "name/", so it sorts as "name/" among its siblings.
            items.append((rel + name + ("/" if is_dir else ""), entry, is_dir))
        items.sort(key=lambda t: t[0])
        for sort_key, entry, is_dir in items:
            if is_dir:
                if (
                    start_after is not None
                    and not start_after.startswith(sort_key)
                    and start_after > sort_key
                ):
                    continue
                yield from self._walk(Path(entry.path), sort_key, "", start_after)
            else:
                if start_after is not None and sort_key <= start_after:
                    continue
                try:
                    size = entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue
                yield ObjectInfo(key=sort_key, size=size, etag=None)

    def exists(self, key: str) -> bool:
        """Whether an object is stored at ``key``.

        Args:
            key: Object key.

        Returns:
            True if an object is there.
        """
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        """Delete an object; a missing key is fine. Empty parent directories are removed.

        Any key a listing returns can be deleted, also one that stoa would refuse to write (a backslash,
        a control character, a non-UTF-8 name).

        Args:
            key: Object key.
        """
        path = self._found(key)
        with self._key_lock(key):
            try:
                os.unlink(path)
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                return
        self._prune_empty_dirs(path.parent)

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object whose key starts with ``prefix``.

        Args:
            prefix: Plain string prefix of keys ('' deletes everything).

        Returns:
            How many objects were deleted.
        """
        keys = [info.key for info in self.list(prefix)]
        for key in keys:
            self.delete(key)
        return len(keys)

    def put_file(self, key: str, path: str | os.PathLike[str], *, create_only: bool = True) -> None:
        """Copy a local file in as an object, atomically.

        Args:
            key: Object key.
            path: Source file.
            create_only: Fail with ObjectExists if a different object is there (identical is success);
                False overwrites.
        """
        validate_key(key)
        tmp = self._tmp_from_file(path)
        try:
            if create_only:
                extra(self, "HeadObject")  # S3Bucket looks before it uploads a large file
                self._link_create(key, tmp, lambda: file_digest(tmp))
            else:
                with self._key_lock(key):
                    self._replace(key, tmp)
        finally:
            _unlink_quiet(tmp)

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Copy an object out to ``path`` (temp file next to it, then rename).

        Args:
            key: Object key.
            path: Destination file; its directory must exist.

        Raises:
            ObjectNotFound: Nothing is stored at ``key``.
        """
        src = self._path(key)
        dest = Path(path)
        part = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:12]}.part")
        try:
            with open(src, "rb") as f, open(part, "wb") as out:
                shutil.copyfileobj(f, out, _COPY_CHUNK)
                out.flush()
                os.fsync(out.fileno())
            os.replace(part, dest)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            _unlink_quiet(part)
            if exc.filename is not None and os.fspath(exc.filename) == os.fspath(src):
                raise ObjectNotFound(f"{self.url}: no object at key {key!r}") from None
            raise
        except BaseException:
            _unlink_quiet(part)
            raise


def _check_range(start: int, end: int) -> None:
    if start < 0 or end < start:
        raise ValueError(f"invalid byte range [{start}, {end})")


def _unlink_quiet(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
