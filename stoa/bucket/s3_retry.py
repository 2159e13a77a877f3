"""How the S3 bucket fails: obstore errors mapped to BucketError types, and the retry loop around requests.

Every S3 request goes through :meth:`S3Failures.attempts`: transient failures (5xx, 408/409/429,
connection errors) are retried with the bucket's :class:`~stoa.bucket.outage.RetryPolicy`; the rest map
to one ``BucketError`` subclass whose message names the operation, the bucket and the key, and never
contains a secret.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit

from obstore.exceptions import (
    AlreadyExistsError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
)
from obstore.exceptions import BaseError as ObstoreError

from .base import (
    AccessDenied,
    BucketError,
    BucketUnreachable,
    ObjectExists,
    ObjectNotFound,
    PreconditionFailed,
)
from .credentials import S3Credentials, scrub_secrets
from .outage import RetryPolicy

_T = TypeVar("_T")
MESSAGE_LIMIT = 300
"""Longest store message quoted in an error."""
STATUS = re.compile(r"status code: (\d{3})")
"""Finds the HTTP status in an obstore error message."""

# obstore runs a tokio runtime that does not survive fork(): a forked child of a process that already
# made an obstore request hangs on its first request. We remember the first process that made one.
_obstore_pid: int | None = None


def check_fork() -> None:
    """Refuse to use obstore in a process forked from one that already used it (it would hang)."""
    global _obstore_pid
    pid = os.getpid()
    if _obstore_pid is None:
        _obstore_pid = pid
    elif _obstore_pid != pid:
        raise BucketError(
            f"obstore was already used in process {_obstore_pid} and this process ({pid}) was forked "
            "from it; obstore is not fork-safe. Start worker processes with the 'spawn' start method "
            "(multiprocessing.get_context('spawn'))."
        )


class Transient(Exception):
    """A failure worth retrying; carries the scrubbed message."""


class Budget:
    """Failures so far and start time of one retried operation."""

    def __init__(self) -> None:
        self.failures = 0
        self.started = time.monotonic()


class S3Failures:
    """Error mapping and retries for one S3 bucket.

    Args:
        url: the bucket URL (for messages).
        endpoint: the endpoint, redacted (for messages).
        bucket: the bucket name.
        creds: the credentials (their secrets are scrubbed from every message).
        retry: the retry budget.
    """

    def __init__(self, url: str, endpoint: str, bucket: str, creds: S3Credentials, retry: RetryPolicy) -> None:
        self.url, self.endpoint, self.bucket, self.creds, self.retry = url, endpoint, bucket, creds, retry

    def scrub(self, text: str) -> str:
        """``text`` without the credentials' secrets (and an endpoint URL's password)."""
        secrets = list(self.creds.secrets())
        if self.creds.endpoint:
            userinfo = urlsplit(self.creds.endpoint).password
            if userinfo:
                secrets.append(userinfo)
        return scrub_secrets(text, secrets)

    def short(self, exc: BaseException) -> str:
        """The first line of an exception, bounded and scrubbed."""
        first = str(exc).strip().split("\n", 1)[0]
        if len(first) > MESSAGE_LIMIT:
            first = first[:MESSAGE_LIMIT] + "…"
        return self.scrub(f"{type(exc).__name__}: {first}")

    def translate(self, exc: BaseException, op: str, key: str) -> BaseException:
        """Map an obstore failure to a BucketError, or to ``Transient`` if it is worth retrying."""
        where = f"{op} {self.url}" + (f" key {key!r}" if key else "")
        if not isinstance(exc, (ObstoreError, FileNotFoundError)):
            return exc
        short = self.short(exc)
        denied = f"{where}: access denied by {self.endpoint} for credentials from {self.creds.source} ({short})"
        if "NoSuchBucket" in str(exc):
            return BucketError(f"{where}: bucket {self.bucket!r} does not exist at {self.endpoint}")
        if isinstance(exc, FileNotFoundError):
            return ObjectNotFound(f"{where}: no such object")
        if isinstance(exc, AlreadyExistsError):
            return ObjectExists(f"{where}: an object already exists at the key")
        if isinstance(exc, PreconditionError):
            return PreconditionFailed(f"{where}: precondition failed (etag changed)")
        if isinstance(exc, (PermissionDeniedError, UnauthenticatedError)):
            return AccessDenied(denied)
        m = STATUS.search(str(exc))
        status = int(m.group(1)) if m else None
        if status in (401, 403):
            return AccessDenied(denied)
        if status is None or status >= 500 or status in (408, 409, 429):
            return Transient(short)
        return BucketError(f"{where}: {short}")

    def recover(self, exc: Exception, op: str, key: str, budget: Budget) -> None:
        """Raise ``exc`` translated to a BucketError, or sleep before the next try if it is transient."""
        err = self.translate(exc, op, key)
        if err is exc:
            raise exc
        if not isinstance(err, Transient):
            raise err from None
        budget.failures += 1
        policy = self.retry
        elapsed = time.monotonic() - budget.started
        delay = policy.delay(budget.failures)
        if budget.failures >= policy.max_attempts or elapsed + delay > policy.total_timeout_s:
            raise BucketUnreachable(
                f"{op} on {self.url} failed: endpoint {self.endpoint} unreachable or failing after "
                f"{budget.failures} attempt(s) over {elapsed:.1f}s (retry budget "
                f"{policy.total_timeout_s:g}s); last error: {err}"
            ) from None
        time.sleep(delay)

    def attempts(self, op: str, key: str, fn: Callable[[int], _T]) -> _T:
        """Run ``fn(failures)`` until it succeeds, retrying transient failures within the budget.

        ``failures`` is 0 on the first try; a retry means an earlier try failed in a way that may or
        may not have reached the store.
        """
        budget = Budget()
        while True:
            try:
                return fn(budget.failures)
            except BucketError:
                raise
            except Exception as exc:
                self.recover(exc, op, key, budget)
