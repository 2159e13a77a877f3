"""Bucket on S3-compatible stores (AWS S3, R2, MinIO, SeaweedFS) through obstore, with retries."""

from __future__ import annotations

import mmap
import os
import re
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import obstore as obs
import xxhash
from obstore.exceptions import (
    AlreadyExistsError,
    NotModifiedError,
    PreconditionError,
)
from obstore.exceptions import BaseError as ObstoreError
from obstore.store import S3Store

from .base import (
    BucketError,
    ObjectExists,
    ObjectNotFound,
    PreconditionFailed,
    content_digest,
    validate_key,
)
from .credentials import S3Credentials, redact_url
from .meter import extra, metered
from .outage import RetryPolicy
from .s3_files import DOWNLOAD_CHUNK, MAX_SINGLE_PUT, MIB, S3Files
from .s3_list import S3Listing, obstore_can_name
from .s3_raw import RawS3
from .s3_retry import STATUS, S3Failures, check_fork

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig, S3Credential

__all__ = ["Listing", "RetryPolicy", "S3Bucket"]

_T = TypeVar("_T")
Listing = Literal["server", "client"]

_DELETE_BATCH = 1000

class _StaticCredentials:
    """obstore credential provider returning fixed credentials (so obstore ignores AWS_* in os.environ)."""

    def __init__(self, creds: S3Credentials) -> None:
        self._creds = creds

    def __call__(self) -> S3Credential:
        return {
            "access_key_id": self._creds.access_key_id,
            "secret_access_key": self._creds.secret_access_key,
            "token": self._creds.session_token,
            "expires_at": None,
        }

    def __repr__(self) -> str:
        return "_StaticCredentials(***)"


@metered
class S3Bucket(S3Listing, S3Files):
    """A bucket (optionally under a key prefix) on an S3-compatible store.

    Conditional writes use ``If-None-Match: *`` (create) and ``If-Match: <etag>`` (CAS). All retrying
    happens here: obstore's own retries are off for single requests, so this layer knows which earlier
    attempt of a conditional write may have landed; multipart parts and streamed downloads keep a few
    obstore-level retries so one failed part does not restart a large transfer.

    The obstore store is created lazily, once per process. obstore is not fork-safe: processes that
    use a bucket must be started with the 'spawn' method; a forked child of a process that already
    made a request gets a BucketError instead of a hang.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        credentials: S3Credentials,
        scheme: str = "s3",
        retry: RetryPolicy | None = None,
        listing: Listing = "server",
        connect_timeout_s: float = 5.0,
        request_timeout_s: float = 600.0,
        part_size: int = 16 * MIB,
        max_concurrency: int = 4,
    ) -> None:
        """Describe an S3 bucket; nothing is contacted until the first operation.

        Args:
            bucket: Bucket name.
            prefix: Key prefix inside the bucket ('' for the root); keys are relative to it.
            credentials: Credentials and endpoint.
            scheme: URL scheme for display ("s3" or "r2").
            retry: Retry policy for transient failures (default: 20 s budget).
            listing: "server" trusts the store to list in lexicographic order and to honour
                start-after (AWS S3, R2, MinIO, moto); "client" lists the whole directory of the prefix
                and sorts locally (needed for SeaweedFS, which lists in directory-tree order).
            connect_timeout_s: TCP/TLS connect timeout of one request.
            request_timeout_s: Timeout of one whole request (large single PUTs need it long).
            part_size: Multipart part size.
            max_concurrency: Parts uploaded concurrently.
        """
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", bucket):
            raise ValueError(f"invalid bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            validate_key(prefix)
        if listing not in ("server", "client"):
            raise ValueError(f"listing must be 'server' or 'client', got {listing!r}")
        if part_size < 5 * MIB:
            raise ValueError("part_size must be at least 5 MiB (S3 minimum)")
        self.bucket = bucket
        self.prefix = prefix
        self.url = f"{scheme}://{bucket}" + (f"/{prefix}" if prefix else "")
        self._creds = credentials
        self._retry = retry or RetryPolicy()
        self._listing: Listing = listing
        self._connect_timeout_s = connect_timeout_s
        self._request_timeout_s = request_timeout_s
        self._part_size = part_size
        self._max_concurrency = max_concurrency
        self.endpoint = (
            redact_url(credentials.endpoint) if credentials.endpoint else f"AWS S3 ({credentials.region})"
        )
        self._failures = S3Failures(self.url, self.endpoint, bucket, credentials, self._retry)
        self._raw = RawS3(self._failures, timeout_s=min(request_timeout_s, 60.0))
        self._raw_prefixes: set[str] = set()
        self._lock = threading.Lock()
        self._stores: dict[bool, S3Store] = {}
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return f"S3Bucket({self.url!r}, endpoint={self.endpoint!r}, listing={self._listing!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_lock"] = None
        state["_stores"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._pid = os.getpid()

    # ------------------------------------------------------------------ store

    def _store(self, bulk: bool = False) -> S3Store:
        check_fork()
        with self._lock:
            if self._pid != os.getpid():
                self._stores = {}
                self._pid = os.getpid()
            store = self._stores.get(bulk)
            if store is None:
                store = self._make_store(bulk)
                self._stores[bulk] = store
            return store

    def _make_store(self, bulk: bool) -> S3Store:
        # User info in an endpoint URL means nothing to SigV4 and would end up in error messages.
        endpoint = redact_url(self._creds.endpoint) if self._creds.endpoint else None
        client: ClientConfig = {
            "connect_timeout": timedelta(seconds=self._connect_timeout_s),
            "timeout": timedelta(seconds=self._request_timeout_s),
        }
        if endpoint and endpoint.startswith("http://"):
            client["allow_http"] = True
        if bulk:
            retry: RetryConfig = {
                "max_retries": 3,
                "backoff": {
                    "init_backoff": timedelta(milliseconds=100),
                    "max_backoff": timedelta(seconds=2),
                    "base": 2,
                },
                "retry_timeout": timedelta(seconds=max(1.0, min(self._retry.total_timeout_s, 30.0))),
            }
        else:
            retry = {"max_retries": 0}
        kwargs: dict[str, Any] = {
            "region": self._creds.region,
            "conditional_put": "etag",
            "skip_signature": False,
        }
        if endpoint:
            # Pass both: obstore reads AWS_ENDPOINT_URL_S3 from os.environ and it beats `endpoint`.
            kwargs["endpoint"] = endpoint
            kwargs["aws_endpoint_url_s3"] = endpoint
            kwargs["virtual_hosted_style_request"] = False
        return S3Store(
            self.bucket,
            client_options=client,
            retry_config=retry,
            credential_provider=_StaticCredentials(self._creds),
            **kwargs,
        )

    # ----------------------------------------------------------------- errors

    def _full(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, path: str) -> str:
        return path[len(self.prefix) + 1 :] if self.prefix else path

    # ---------------------------------------------------------------- helpers

    def _stored_digest(self, path: str) -> tuple[int, str]:
        """Size and content digest of the stored object, streamed."""
        extra(self, "GetObject")
        result = obs.get(self._store(bulk=True), path)
        h = xxhash.xxh3_128()
        size = 0
        for chunk in result.stream(min_chunk_size=DOWNLOAD_CHUNK):
            h.update(chunk)
            size += len(chunk)
        return size, h.hexdigest()

    def _landed(self, path: str, data: bytes) -> str | None:
        """Etag of the stored object if it holds exactly ``data``, else None."""
        extra(self, "GetObject")
        try:
            got = obs.get(self._store(), path)
        except FileNotFoundError:
            return None
        current = got.meta["e_tag"]
        if current is not None and bytes(got.bytes()) == data:
            return current
        return None

    def _same_content(self, path: str, size: int, digest: Callable[[], str]) -> bool:
        extra(self, "HeadObject")
        meta = obs.head(self._store(), path)
        if meta["size"] != size:
            return False
        return self._stored_digest(path)[1] == digest()

    def _create(
        self,
        op: str,
        key: str,
        path: str,
        body: Callable[[], AbstractContextManager[bytes | mmap.mmap]],
        size: int,
        digest: Callable[[], str],
    ) -> None:
        """One ``If-None-Match: *`` PUT; on 412 compare the stored object with ours (equal is success)."""

        def attempt(_: int) -> None:
            for _round in range(3):
                with body() as payload:
                    try:
                        obs.put(self._store(), path, payload, mode="create", use_multipart=False)
                        return
                    except AlreadyExistsError:
                        pass
                try:
                    same = self._same_content(path, size, digest)
                except FileNotFoundError:
                    continue  # deleted since the 412 (or the store has a "directory" there): try again
                if not same:
                    raise ObjectExists(f"{op} {self.url} key {key!r}: a different object exists")
                return
            raise BucketError(
                f"{op} {self.url} key {key!r}: the store says the key exists but no object can be read "
                "there; on SeaweedFS (as in local buckets) a key cannot be both an object and a prefix "
                "of other keys ('a' and 'a/b')"
            )

        self._failures.attempts(op, key, attempt)

    # --------------------------------------------------------------- protocol

    def put_create(self, key: str, data: bytes) -> None:
        """Create-only atomic put (``If-None-Match: *``).

        If the key already holds byte-identical content this is a success, so a retried create whose
        first response was lost does not fail.

        Args:
            key: Object key.
            data: Object content (at most 5 GiB: one PUT).

        Raises:
            ObjectExists: A different object is stored at ``key``.
        """
        validate_key(key)
        if len(data) > MAX_SINGLE_PUT:
            raise ValueError("put_create is one PUT and S3 caps a PUT at 5 GiB")
        path = self._full(key)

        self._create(
            "put_create", key, path, lambda: nullcontext(data), len(data), lambda: content_digest(data)
        )

    def put(self, key: str, data: bytes) -> None:
        """Unconditional atomic overwrite (multipart for large data).

        Args:
            key: Object key.
            data: Object content.
        """
        validate_key(key)
        path = self._full(key)
        multipart = len(data) > 4 * self._part_size

        def attempt(_: int) -> None:
            if multipart:
                obs.put(
                    self._store(bulk=True),
                    path,
                    data,
                    use_multipart=True,
                    chunk_size=self._part_size,
                    max_concurrency=self._max_concurrency,
                )
            else:
                obs.put(self._store(), path, data, mode="overwrite", use_multipart=False)

        self._failures.attempts("put", key, attempt)

    def get(self, key: str) -> bytes:
        """Read a whole object.

        Args:
            key: Object key.

        Returns:
            The content.

        Raises:
            ObjectNotFound: Nothing is stored at ``key``.
        """
        return self.get_with_etag(key)[0]

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        """Read a whole object and its etag (from the same response).

        Args:
            key: Object key.

        Returns:
            (content, etag).

        Raises:
            ObjectNotFound: Nothing is stored at ``key``.
        """
        validate_key(key)
        path = self._full(key)

        def attempt(_: int) -> tuple[bytes, str]:
            result = obs.get(self._store(), path)
            etag = result.meta["e_tag"]
            data = bytes(result.bytes())
            if etag is None:
                raise BucketError(f"get {self.url} key {key!r}: the store returned no ETag")
            return data, etag

        return self._failures.attempts("get", key, attempt)

    def get_if_changed(self, key: str, etag: str | None) -> tuple[bytes, str] | None:
        """Conditional GET (``If-None-Match: <etag>``).

        Args:
            key: Object key.
            etag: The etag the caller holds, or None to always read.

        Returns:
            (content, etag), or None when the stored etag still equals ``etag``.

        Raises:
            ObjectNotFound: Nothing is stored at ``key``.
        """
        if etag is None:
            return self.get_with_etag(key)
        validate_key(key)
        path = self._full(key)

        def attempt(_: int) -> tuple[bytes, str] | None:
            try:
                result = obs.get(self._store(), path, options={"if_none_match": etag})
            except NotModifiedError:
                return None
            current = result.meta["e_tag"]
            if current == etag:  # the store ignored If-None-Match
                return None
            if current is None:
                raise BucketError(f"get {self.url} key {key!r}: the store returned no ETag")
            return bytes(result.bytes()), current

        return self._failures.attempts("get_if_changed", key, attempt)

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
        validate_key(key)
        if start < 0 or end < start:
            raise ValueError(f"invalid byte range [{start}, {end})")
        if start == end:
            if not self.exists(key):
                raise ObjectNotFound(f"get_range {self.url} key {key!r}: no such object")
            return b""
        path = self._full(key)

        def attempt(_: int) -> bytes:
            try:
                return bytes(obs.get_range(self._store(), path, start=start, end=end))
            except ObstoreError as exc:
                if "416" in STATUS.findall(str(exc)):
                    return b""  # the range starts at or past the end of the object
                raise

        return self._failures.attempts("get_range", key, attempt)

    def cas(self, key: str, data: bytes, expected_etag: str | None) -> str:
        """Compare-and-swap (``If-Match: <etag>``, or ``If-None-Match: *`` when ``expected_etag`` is None).

        If a try failed transiently and the retry then loses the precondition, the stored object is
        read back: when it holds exactly ``data`` the earlier try landed and this counts as success.

        Args:
            key: Object key.
            data: New content (one PUT, at most 5 GiB).
            expected_etag: Etag that must be stored now, or None if the key must not exist.

        Returns:
            The new etag.

        Raises:
            PreconditionFailed: The stored object is not the expected one.
        """
        validate_key(key)
        if len(data) > MAX_SINGLE_PUT:
            raise ValueError("cas is one PUT and S3 caps a PUT at 5 GiB")
        path = self._full(key)
        mode: Any = "create" if expected_etag is None else {"e_tag": expected_etag}

        def attempt(failures: int) -> str:
            try:
                result = obs.put(self._store(), path, data, mode=mode, use_multipart=False)
            except (AlreadyExistsError, PreconditionError):
                if failures > 0:
                    landed = self._landed(path, data)
                    if landed is not None:
                        return landed
                raise PreconditionFailed(
                    f"cas {self.url} key {key!r}: expected "
                    + ("no object" if expected_etag is None else f"etag {expected_etag}")
                    + ", the stored object differs"
                ) from None
            etag = result["e_tag"]
            if etag is None:
                extra(self, "HeadObject")
                etag = obs.head(self._store(), path)["e_tag"]
            if etag is None:
                raise BucketError(f"cas {self.url} key {key!r}: the store returned no ETag")
            return etag

        return self._failures.attempts("cas", key, attempt)

    def exists(self, key: str) -> bool:
        """Whether an object is stored at ``key`` (HEAD).

        Args:
            key: Object key.

        Returns:
            True if an object is there.
        """
        validate_key(key)
        path = self._full(key)

        def attempt(_: int) -> bool:
            try:
                obs.head(self._store(), path)
            except FileNotFoundError as exc:
                if "NoSuchBucket" in str(exc):
                    raise
                return False
            return True

        return self._failures.attempts("exists", key, attempt)

    def delete(self, key: str) -> None:
        """Delete an object; a missing key is fine.

        Any key a listing returns can be deleted: one obstore cannot name (a control character; an empty,
        '.' or '..' segment; a trailing '/') goes out as a raw DeleteObject request naming it exactly.

        Args:
            key: Object key.
        """
        if not obstore_can_name(key):
            if not isinstance(key, str) or not key:
                raise ValueError(f"bucket key {key!r} must be a non-empty str")
            self._raw.delete(self._full(key))
            return
        path = self._full(key)

        def attempt(_: int) -> None:
            try:
                obs.delete(self._store(), path)
            except FileNotFoundError as exc:
                if "NoSuchBucket" in str(exc):
                    raise

        self._failures.attempts("delete", key, attempt)

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object whose key starts with ``prefix`` (bulk DeleteObjects, 1000 per request).

        Args:
            prefix: Key prefix ('' deletes everything under the bucket prefix).

        Returns:
            How many objects were listed and deleted (keys obstore cannot name one raw request each).
        """
        listed = [info.key for info in self.list(prefix)]
        keys = [k for k in listed if obstore_can_name(k)]
        for i in range(0, len(keys), _DELETE_BATCH):
            batch: Sequence[str] = [self._full(k) for k in keys[i : i + _DELETE_BATCH]]
            self._failures.attempts("delete_prefix", prefix, lambda _, b=batch: obs.delete(self._store(), b))
        for key in listed:  # keys obstore cannot name (anyone with write credentials can store one)
            if not obstore_can_name(key):
                self._raw.delete(self._full(key))
        return len(listed)
