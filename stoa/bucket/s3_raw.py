"""Raw S3 requests for keys obstore cannot name: ListObjectsV2 with URL-encoded keys, DeleteObject by exact key.

obstore parses every listed key as a path: one key holding a control character or an empty, '.' or '..'
segment fails the whole listing page (``InvalidPathError``), it cannot name such a key in a request, and it
drops a key's trailing '/'. Anyone holding a worker's credentials can store such a key, so the S3 bucket
falls back to these requests (SigV4 signed here, stdlib only, path-style URLs) where obstore cannot serve:
listings come back with ``encoding-type=url`` (every key exact, whatever bytes it holds), deletes name the
exact key.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import time
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import quote, unquote, urlsplit

from .base import AccessDenied, BucketError, BucketUnreachable, ObjectInfo
from .credentials import redact_url
from .s3_retry import S3Failures

_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_TRANSIENT_STATUS = frozenset({408, 409, 429})
_MAX_LISTING_BYTES = 64 << 20
"""A ListObjectsV2 page is at most 1,000 keys of 1 KiB; anything far larger is not a listing."""


@dataclass(frozen=True)
class Page:
    """One ListObjectsV2 page: its objects (full keys, decoded) and the token of the next page, if any."""

    objects: list[ObjectInfo]
    next_token: str | None


class RawS3:
    """Signed ListObjectsV2 and DeleteObject requests on one bucket, retried like every other request.

    Args:
        failures: the bucket's error mapping (credentials, retry policy, message scrubbing).
        timeout_s: seconds one request may take.
        page_size: keys per listing page (S3's most is 1,000).
    """

    def __init__(self, failures: S3Failures, timeout_s: float = 60.0, page_size: int = 1000) -> None:
        self.failures, self.timeout_s, self.page_size = failures, timeout_s, page_size
        creds = failures.creds
        endpoint = redact_url(creds.endpoint) if creds.endpoint else f"https://s3.{creds.region}.amazonaws.com"
        parts = urlsplit(endpoint)
        self._scheme, self._host = parts.scheme, parts.netloc
        self._base = parts.path.rstrip("/") + "/" + quote(failures.bucket, safe="")

    def list(self, prefix: str | None, start_after: str | None) -> Iterator[ObjectInfo]:
        """Every object whose full key starts with ``prefix``, after ``start_after``, in the store's order.

        Args:
            prefix: full-key prefix (None: the whole bucket).
            start_after: full key; only keys after it.
        """
        token: str | None = None
        while True:
            page = self.list_page(prefix, start_after, token)
            yield from page.objects
            if page.next_token is None:
                return
            token = page.next_token

    def list_page(self, prefix: str | None, start_after: str | None, token: str | None) -> Page:
        """One ListObjectsV2 page (up to ``page_size`` keys).

        Args:
            prefix: full-key prefix (None: the whole bucket).
            start_after: full key; only keys after it (ignored by the store with a continuation token).
            token: the previous page's continuation token.
        """
        query = [("list-type", "2"), ("encoding-type", "url"), ("max-keys", str(self.page_size))]
        query += [(k, v) for k, v in (("prefix", prefix), ("start-after", start_after),
                                      ("continuation-token", token)) if v]
        body = self._request("GET", "", query, "list", prefix or "")
        return _parse_page(body)

    def delete(self, key: str) -> None:
        """Delete the object at the exact full key ``key`` (a missing key is fine).

        Args:
            key: full key, any string S3 can hold.
        """
        self._request("DELETE", key, [], "delete", key)

    def _request(self, method: str, key: str, query: list[tuple[str, str]], op: str, what: str) -> bytes:
        """Send one signed request, retrying transient failures within the bucket's retry budget."""
        policy, started, failures = self.failures.retry, time.monotonic(), 0
        while True:
            try:
                return self._send(method, key, query)
            except urllib.error.HTTPError as e:
                if e.code < 500 and e.code not in _TRANSIENT_STATUS:
                    raise self._refused(e, op, what) from None
                last: Exception = e
            except (OSError, http.client.HTTPException) as e:  # URLError, timeouts, resets, a cut-off response
                last = e
            failures += 1
            elapsed, delay = time.monotonic() - started, policy.delay(failures)
            if failures >= policy.max_attempts or elapsed + delay > policy.total_timeout_s:
                raise BucketUnreachable(
                    f"{op} on {self.failures.url} (raw request) failed: endpoint {self.failures.endpoint} "
                    f"unreachable or failing after {failures} attempt(s) over {elapsed:.1f}s; last error: "
                    f"{self.failures.short(last)}") from None
            time.sleep(delay)

    def _refused(self, e: urllib.error.HTTPError, op: str, what: str) -> BucketError:
        where = f"{op} {self.failures.url} key {what[:200]!r} (raw request)"
        if e.code in (401, 403):
            return AccessDenied(f"{where}: access denied by {self.failures.endpoint} ({self.failures.short(e)})")
        return BucketError(f"{where}: {self.failures.short(e)}")

    def _send(self, method: str, key: str, query: list[tuple[str, str]]) -> bytes:
        path = self._base + ("/" + quote(key, safe="/-_.~") if key else "/")
        canonical_query = "&".join(f"{_enc(k)}={_enc(v)}" for k, v in sorted(query))
        headers = _signed_headers(self.failures, method, self._host, path, canonical_query)
        url = f"{self._scheme}://{self._host}{path}" + (f"?{canonical_query}" if canonical_query else "")
        req = urllib.request.Request(url, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310 (the bucket's endpoint)
            return resp.read(_MAX_LISTING_BYTES)


def _enc(text: str) -> str:
    """URI-encode for SigV4 (every byte but unreserved characters)."""
    return quote(text, safe="-_.~")


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def _signed_headers(failures: S3Failures, method: str, host: str, path: str, canonical_query: str) -> dict[str, str]:
    """The headers of a SigV4-signed request with an empty body."""
    creds = failures.creds
    amz_date = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    headers = {"host": host, "x-amz-content-sha256": _EMPTY_SHA256, "x-amz-date": amz_date}
    if creds.session_token:
        headers["x-amz-security-token"] = creds.session_token
    names = sorted(headers)
    signed = ";".join(names)
    canonical = "\n".join([method, path, canonical_query, "".join(f"{n}:{headers[n]}\n" for n in names), signed,
                           _EMPTY_SHA256])
    scope = f"{amz_date[:8]}/{creds.region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = _hmac(("AWS4" + creds.secret_access_key).encode(), amz_date[:8])
    for part in (creds.region, "s3", "aws4_request"):
        key = _hmac(key, part)
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={creds.access_key_id}/{scope}, "
                                f"SignedHeaders={signed}, Signature={signature}")
    return headers


def _parse_page(body: bytes) -> Page:
    """Objects and continuation token of a ListObjectsV2 response (keys URL-decoded when the store encoded them)."""
    try:
        root = ET.fromstring(body)
    except ET.ParseError as e:
        raise BucketError(f"the store's listing is not XML ({e})") from None
    encoded = (root.findtext(f"{_NS}EncodingType") or "").lower() == "url"
    objects = []
    for item in root.iter(f"{_NS}Contents"):
        key = item.findtext(f"{_NS}Key") or ""
        size = item.findtext(f"{_NS}Size") or "0"
        etag = item.findtext(f"{_NS}ETag")
        if encoded:
            key = unquote(key, errors="surrogateescape")
        objects.append(ObjectInfo(key=key, size=int(size) if size.isdigit() and len(size) < 20 else 0, etag=etag))
    truncated = (root.findtext(f"{_NS}IsTruncated") or "").lower() == "true"
    token = root.findtext(f"{_NS}NextContinuationToken") if truncated else None
    return Page(objects, token or None)
