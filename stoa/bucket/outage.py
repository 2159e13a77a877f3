"""Outages: the retry policy, local-directory failures as bucket errors, and a bucket that waits them out."""

from __future__ import annotations

import errno
import functools
import inspect
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from .base import AccessDenied, Bucket, BucketUnreachable, ObjectInfo

__all__ = ["PatientBucket", "RetryPolicy", "TRANSIENT_ERRNOS", "map_os_errors"]

_T = TypeVar("_T")
_C = TypeVar("_C", bound=type)

TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("EIO", "ESTALE", "ETIMEDOUT", "ENOTCONN", "EHOSTDOWN", "EHOSTUNREACH", "ENETDOWN",
                 "ENETUNREACH", "ECONNRESET", "ECONNABORTED", "ECONNREFUSED", "EAGAIN", "EBUSY", "ENOSPC",
                 "EDQUOT", "EROFS")
    if hasattr(errno, name)
)
"""errnos of a directory bucket that is unmounted, unreachable (NFS), full or remounted read-only."""

# Methods a local bucket retries under its policy: all but cas (a retry after a landed write would lose
# the precondition) and list (lazy; callers re-list).
_RETRIED = ("put_create", "put", "get", "get_with_etag", "get_if_changed", "get_range", "exists", "delete",
            "delete_prefix", "put_file", "get_file")


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter for transient failures (network errors, 5xx, 408/409/429).

    Attributes:
        total_timeout_s: Give up (BucketUnreachable) once this much time has passed since the first try.
        max_attempts: Give up after this many tries.
        initial_backoff_s: Backoff before the first retry (before jitter).
        max_backoff_s: Cap on one backoff.
    """

    total_timeout_s: float = 20.0
    max_attempts: int = 10
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 4.0

    @classmethod
    def for_budget(cls, seconds: float) -> RetryPolicy:
        """A policy bounded by time only: retry transient failures for ``seconds`` (minutes for workers).

        Backoff doubles from 0.2 s up to 15 s (4 s for budgets under a minute), with jitter, so a long
        outage costs a request every ~8-15 s rather than a tight loop.

        Args:
            seconds: the retry budget of one operation.
        """
        if seconds <= 0:
            raise ValueError(f"retry budget must be positive, got {seconds}")
        return cls(total_timeout_s=seconds, max_attempts=1 << 30, max_backoff_s=15.0 if seconds >= 60 else 4.0)

    def delay(self, failures: int) -> float:
        """Backoff before the next try ("equal jitter": half fixed, half random).

        Args:
            failures: How many tries have failed so far (>= 1).

        Returns:
            Seconds to sleep.
        """
        base = min(self.max_backoff_s, self.initial_backoff_s * (2 ** min(failures - 1, 60)))
        return base / 2 + random.uniform(0, base / 2)


def _os_error(exc: OSError, op: str, url: str) -> Exception:
    """The bucket error an OSError of a directory bucket stands for (``exc`` itself when none)."""
    if exc.errno in TRANSIENT_ERRNOS:
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        return BucketUnreachable(f"{op} on {url} failed: {exc.strerror or exc} ({name}); the directory is "
                                 "unreachable, full or read-only")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return AccessDenied(f"{op} on {url}: permission denied ({exc.strerror}); check the directory's owner "
                            "and mode")
    return exc


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def gen(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
            try:
                yield from fn(self, *args, **kwargs)
            except OSError as exc:
                err = _os_error(exc, name, self.url)
                if err is exc:
                    raise
                raise err from None

        return gen

    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        policy: RetryPolicy | None = getattr(self, "retry", None) if name in _RETRIED else None
        started, failures = time.monotonic(), 0
        while True:
            try:
                return fn(self, *args, **kwargs)
            except OSError as exc:
                err = _os_error(exc, name, self.url)
                if err is exc:
                    raise
                failures += 1
                elapsed = time.monotonic() - started
                delay = policy.delay(failures) if policy is not None else 0.0
                if (policy is None or not isinstance(err, BucketUnreachable) or failures >= policy.max_attempts
                        or elapsed + delay > policy.total_timeout_s):
                    raise err from None
                time.sleep(delay)

    return call


def map_os_errors(cls: _C) -> _C:
    """Class decorator for a directory bucket: an unusable directory raises BucketUnreachable (retried
    under the instance's ``retry`` policy, if any, like S3's transient errors), a permission error
    AccessDenied; other OSErrors pass through.

    Args:
        cls: the bucket class; its ``retry`` attribute (a RetryPolicy or None) is read per call.
    """
    for name in (*_RETRIED, "cas", "list"):
        setattr(cls, name, _wrap(name, getattr(cls, name)))
    return cls


class PatientBucket:
    """A bucket that waits out outages instead of failing: for rollout workers.

    An operation that raises BucketUnreachable (the inner bucket already spent its retry budget) is
    retried after a jittered pause that doubles up to ``max_wait_s``, for as long as the outage lasts,
    with one note line per pause and one when the bucket answers again. With ``exit_on_outage`` the
    error propagates instead (the worker exits, code 4). Every other error passes through at once.
    Retrying is safe because every retried operation is idempotent: ``put_create`` treats identical
    content as success (a write whose response was lost is not an error and not a duplicate), reads and
    deletes repeat harmlessly. ``cas`` is passed through unretried (a landed write would lose its
    precondition). Listings are read whole before they are returned, so a retry never repeats keys.

    Args:
        inner: the bucket.
        exit_on_outage: raise BucketUnreachable instead of waiting.
        note: where the outage lines go.
        base_wait_s: first pause.
        max_wait_s: longest pause.
        sleep: sleep function (tests pass a fake one).
        clock: monotonic clock.
    """

    def __init__(self, inner: Bucket, *, exit_on_outage: bool = False, note: Callable[[str], None] = print,
                 base_wait_s: float = 1.0, max_wait_s: float = 60.0, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = inner
        self.url = inner.url
        self.exit_on_outage = exit_on_outage
        self._note = note
        self._base, self._max = base_wait_s, max_wait_s
        self._sleep, self._clock = sleep, clock
        self.outages = 0
        """Operations that had to wait out an outage (each counted once)."""
        self.waited_s = 0.0
        """Total seconds spent waiting."""

    def __repr__(self) -> str:
        return f"PatientBucket({self.inner!r})"

    def _call(self, op: str, key: str, fn: Callable[[], _T]) -> _T:
        started: float | None = None
        failures = 0
        while True:
            try:
                result = fn()
            except BucketUnreachable as exc:
                if self.exit_on_outage:
                    raise
                now = self._clock()
                if started is None:
                    started = now
                    self.outages += 1
                failures += 1
                base = min(self._max, self._base * 2 ** min(failures - 1, 30))
                wait = base / 2 + random.uniform(0, base / 2)
                self._note(f"[bucket] {op} {key}: unreachable ({str(exc)[:300]}); waiting {wait:.0f}s and "
                           f"retrying (outage {now - started:.0f}s so far)")
                self._sleep(wait)
                self.waited_s += wait
                continue
            if started is not None:
                self._note(f"[bucket] {op} {key}: answered again after {self._clock() - started:.0f}s")
            return result

    def put_create(self, key: str, data: bytes) -> None:
        """Create-only put (identical content already there is success), waiting out outages."""
        self._call("put_create", key, lambda: self.inner.put_create(key, data))

    def put(self, key: str, data: bytes) -> None:
        """Unconditional atomic overwrite, waiting out outages."""
        self._call("put", key, lambda: self.inner.put(key, data))

    def get(self, key: str) -> bytes:
        """Whole object, waiting out outages."""
        return self._call("get", key, lambda: self.inner.get(key))

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        """Whole object and its etag, waiting out outages."""
        return self._call("get", key, lambda: self.inner.get_with_etag(key))

    def get_if_changed(self, key: str, etag: str | None) -> tuple[bytes, str] | None:
        """Conditional GET (None when unchanged), waiting out outages."""
        return self._call("get", key, lambda: self.inner.get_if_changed(key, etag))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``, waiting out outages."""
        return self._call("get_range", key, lambda: self.inner.get_range(key, start, end))

    def cas(self, key: str, data: bytes, expected_etag: str | None) -> str:
        """Compare-and-swap, passed through unretried (a landed write would lose its precondition)."""
        return self.inner.cas(key, data, expected_etag)

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """The whole listing, read before it is returned, waiting out outages."""
        return iter(self._call("list", prefix, lambda: list(self.inner.list(prefix, start_after))))

    def exists(self, key: str) -> bool:
        """Whether the key holds an object, waiting out outages."""
        return self._call("exists", key, lambda: self.inner.exists(key))

    def delete(self, key: str) -> None:
        """Delete (a missing key is fine), waiting out outages."""
        self._call("delete", key, lambda: self.inner.delete(key))

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix``, waiting out outages."""
        return self._call("delete_prefix", prefix, lambda: self.inner.delete_prefix(prefix))

    def put_file(self, key: str, path: str | os.PathLike[str], *, create_only: bool = True) -> None:
        """Upload a local file, waiting out outages."""
        self._call("put_file", key, lambda: self.inner.put_file(key, path, create_only=create_only))

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Download to ``path``, waiting out outages."""
        self._call("get_file", key, lambda: self.inner.get_file(key, path))
