"""Bucket request metering: every bucket operation counted as the S3 requests it costs, by billing class.

R2 (and S3) bill requests in classes, not bytes moved: class A (writes, lists, multipart steps, copies),
class B (GET, HEAD) and free ones (DeleteObject, AbortMultipartUpload). :func:`metered` is a class decorator
for bucket backends: each protocol call adds the requests an :class:`~stoa.bucket.s3.S3Bucket` makes for it
to the process's :data:`METER` (or the instance's ``meter``), so a local directory bucket counts what the
same run would cost on R2. Only the outermost call counts (``get`` calling ``get_with_etag`` is one GET).
Stdlib only.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["CLASS_OF", "METER", "PART_SIZE", "Counts", "RequestMeter", "extra", "http_request_name", "metered",
           "requests_for"]

_C = TypeVar("_C", bound=type)

PART_SIZE = 16 << 20
"""Multipart part size of S3Bucket (its default); a local bucket is metered as if it had it."""
LIST_PAGE = 1000
"""Keys per ListObjectsV2 page and per DeleteObjects request."""

CLASS_OF: Mapping[str, str] = {
    "PutObject": "a", "CopyObject": "a", "ListObjectsV2": "a", "CreateMultipartUpload": "a",
    "UploadPart": "a", "CompleteMultipartUpload": "a", "DeleteObjects": "a",
    "GetObject": "b", "HeadObject": "b",
    "DeleteObject": "free", "AbortMultipartUpload": "free",
}
"""The billing class of each S3 request stoa makes: ``a``, ``b`` or ``free`` (R2's lists; DeleteObjects is
billed as class A by R2, a single DeleteObject is free)."""


@dataclass(frozen=True)
class Counts:
    """Requests by class and bytes moved, cumulative for one process (or a sum of processes).

    Attributes:
        a: class-A requests (PUT, LIST, multipart steps, bulk deletes).
        b: class-B requests (GET, HEAD).
        free: requests R2 does not bill (single DeleteObject).
        written: bytes uploaded.
        read: bytes downloaded (egress: free on R2).
    """

    a: int = 0
    b: int = 0
    free: int = 0
    written: int = 0
    read: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.a + other.a, self.b + other.b, self.free + other.free, self.written + other.written,
                      self.read + other.read)

    def __sub__(self, other: Counts) -> Counts:
        return Counts(self.a - other.a, self.b - other.b, self.free - other.free, self.written - other.written,
                      self.read - other.read)

    def as_dict(self, prefix: str = "") -> dict[str, int]:
        """``{prefix + "a": ..., ...}`` for a metrics row or a record header."""
        return {f"{prefix}{k}": v for k, v in (("a", self.a), ("b", self.b), ("free", self.free),
                                                ("written", self.written), ("read", self.read))}


class RequestMeter:
    """A thread-safe tally of S3 requests by name, with bytes written and read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_request: dict[str, int] = {}
        self._written = self._read = 0

    def add(self, request: str, n: int = 1, *, written: int = 0, read: int = 0) -> None:
        """Count ``n`` requests named ``request`` (a key of :data:`CLASS_OF`) and the bytes they moved."""
        if request not in CLASS_OF:
            raise ValueError(f"unknown S3 request {request!r}; add it to stoa.bucket.meter.CLASS_OF")
        with self._lock:
            self._by_request[request] = self._by_request.get(request, 0) + n
            self._written += written
            self._read += read

    def by_request(self) -> dict[str, int]:
        """Requests so far by S3 request name."""
        with self._lock:
            return dict(self._by_request)

    def counts(self) -> Counts:
        """Requests so far by billing class, and bytes."""
        with self._lock:
            by_class = {"a": 0, "b": 0, "free": 0}
            for name, n in self._by_request.items():
                by_class[CLASS_OF[name]] += n
            return Counts(by_class["a"], by_class["b"], by_class["free"], self._written, self._read)


METER = RequestMeter()
"""The process's meter: every bucket this process opens counts here."""

_depth = threading.local()


def _size(data: Any) -> int:
    try:
        return len(data)
    except TypeError:
        return 0


def _upload(size: int, part_size: int, multipart: bool) -> list[tuple[str, int]]:
    """The requests of one upload of ``size`` bytes: one PUT, or create + parts + complete."""
    if not multipart:
        return [("PutObject", 1)]
    return [("CreateMultipartUpload", 1), ("UploadPart", max(1, math.ceil(size / part_size))),
            ("CompleteMultipartUpload", 1)]


def requests_for(op: str, args: tuple[Any, ...], kwargs: Mapping[str, Any], result: Any, failed: BaseException | None,
                 part_size: int = PART_SIZE) -> list[tuple[str, int]]:
    """The S3 requests one bucket operation makes (as S3Bucket makes them), as ``(request, count)`` pairs.

    Args:
        op: the bucket method (``put_create``, ``get``, ``list``, ...).
        args: its positional arguments after ``self``.
        kwargs: its keyword arguments.
        result: what it returned (for ``delete_prefix``: how many objects it deleted).
        failed: the exception it raised, if any.
        part_size: the bucket's multipart part size.
    """
    if op == "put_create":
        return [("PutObject", 1)]  # the reads of an object found there count through extra()
    if op == "put":
        return _upload(_size(args[1]), part_size, _size(args[1]) > 4 * part_size)
    if op in ("get", "get_with_etag", "get_if_changed", "get_file"):
        return [("GetObject", 1)]
    if op == "get_range":
        return [("HeadObject", 1)] if len(args) >= 3 and args[1] == args[2] else [("GetObject", 1)]
    if op == "cas":
        return [("PutObject", 1)]
    if op == "exists":
        return [("HeadObject", 1)]
    if op == "delete":
        return [("DeleteObjects", 1)]  # obstore deletes one key with a bulk DeleteObjects request
    if op == "delete_prefix":
        n = result if isinstance(result, int) and result > 0 else 0
        return [("ListObjectsV2", 1 + n // LIST_PAGE)] + ([("DeleteObjects", math.ceil(n / LIST_PAGE))] if n else [])
    if op == "put_file":
        size = int(kwargs.get("size", 0))
        if kwargs.get("create_only", True):
            return [("PutObject", 1)]  # its HEAD first counts through extra()
        return _upload(size, part_size, size > part_size)
    raise ValueError(f"no request model for bucket operation {op!r}")


def extra(bucket: Any, request: str) -> None:
    """Count a request a backend makes only sometimes, inside an operation (the HEAD and GET that compare an
    object a create found with its own content, a create-only upload's HEAD first): S3Bucket where it makes
    them, LocalBucket where S3Bucket would.

    Args:
        bucket: the bucket (its ``meter``, else :data:`METER`).
        request: the S3 request (a key of :data:`CLASS_OF`).
    """
    meter: RequestMeter = getattr(bucket, "meter", None) or METER
    meter.add(request)


def _written(op: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    if op in ("put_create", "put", "cas"):
        return _size(args[1])
    return int(kwargs.get("size", 0)) if op == "put_file" else 0


def _read(op: str, result: Any) -> int:
    if op in ("get", "get_range"):
        return _size(result)
    if op in ("get_with_etag", "get_if_changed") and isinstance(result, tuple):
        return _size(result[0])
    return 0


def _record(self: Any, op: str, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any,
            failed: BaseException | None) -> None:
    meter: RequestMeter = getattr(self, "meter", None) or METER
    if op == "put_file":
        kwargs = {**kwargs, "size": _file_size(args[1])}
    requests = requests_for(op, args, kwargs, result, failed, getattr(self, "_part_size", PART_SIZE))
    for i, (name, n) in enumerate(requests):
        first = i == 0
        meter.add(name, n, written=_written(op, args, kwargs) if first and failed is None else 0,
                  read=_read(op, result) if first else 0)


def _file_size(path: Any) -> int:
    try:
        return os.stat(path).st_size
    except (OSError, TypeError):
        return 0


def _meter_call(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = not getattr(_depth, "n", 0)
        _depth.n = getattr(_depth, "n", 0) + 1
        result, failed = None, None
        try:
            result = fn(self, *args, **kwargs)
            return result
        except BaseException as exc:
            failed = exc
            raise
        finally:
            _depth.n -= 1
            if outer and not (failed is not None and not isinstance(failed, Exception)):
                _record(self, op, args, kwargs, result, failed)

    return call


def _meter_list(fn: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """A listing counts one ListObjectsV2 page per started 1,000 keys yielded (the guard is held only while
    the listing itself runs, so operations made between its items count on their own)."""

    @functools.wraps(fn)
    def gen(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        outer = not getattr(_depth, "n", 0)
        meter: RequestMeter = getattr(self, "meter", None) or METER
        it, yielded = fn(self, *args, **kwargs), 0
        if outer:
            meter.add("ListObjectsV2")
        while True:
            _depth.n = getattr(_depth, "n", 0) + 1
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                _depth.n -= 1
            yielded += 1
            if outer and yielded % LIST_PAGE == 0:
                meter.add("ListObjectsV2")  # the next item (if any) needs the next page
            yield item

    return gen


_OPS = ("put_create", "put", "get", "get_with_etag", "get_if_changed", "get_range", "cas", "exists", "delete",
        "delete_prefix", "put_file", "get_file")


def metered(cls: _C) -> _C:
    """Class decorator for a bucket backend: count every protocol call's S3 requests (see module doc).

    Args:
        cls: the bucket class; an instance's ``meter`` attribute (a RequestMeter), if set, is used instead
            of :data:`METER`.
    """
    for op in _OPS:
        setattr(cls, op, _meter_call(op, getattr(cls, op)))
    listing = cls.list
    if not inspect.isgeneratorfunction(listing):
        raise TypeError(f"{cls.__name__}.list must be a generator to be metered")
    cls.list = _meter_list(listing)
    return cls


def http_request_name(method: str, query: Mapping[str, Any]) -> str:
    """The S3 request an HTTP request on an object store is (for counting requests server-side).

    Args:
        method: the HTTP method.
        query: the request's query parameters (only the names matter).
    """
    m = method.upper()
    if m == "GET":
        return "ListObjectsV2" if "list-type" in query or "prefix" in query else "GetObject"
    if m == "HEAD":
        return "HeadObject"
    if m == "PUT":
        return "UploadPart" if "partNumber" in query else "PutObject"
    if m == "POST":
        if "delete" in query:
            return "DeleteObjects"
        return "CreateMultipartUpload" if "uploads" in query else "CompleteMultipartUpload"
    if m == "DELETE":
        return "AbortMultipartUpload" if "uploadId" in query else "DeleteObject"
    raise ValueError(f"no S3 request is an HTTP {method}")
