"""Bucket URLs: the forms ``open_bucket`` accepts, parsed before any backend is built."""

from __future__ import annotations

import re
from typing import NamedTuple

ACCEPTED_FORMS = "a directory path, file://DIR, s3://BUCKET[/PREFIX] or r2://BUCKET[/PREFIX]"

_SCHEME_LIKE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(?!//)")
"""``s3:/b/x``, ``r2:bucket``: a scheme followed by fewer than two slashes (two or more letters, so that a
Windows drive ``C:`` is not taken for one)."""

_SCHEME_HINTS = {
    "http": "for an S3-compatible endpoint set AWS_ENDPOINT_URL and use s3://BUCKET[/PREFIX]",
    "https": "for an S3-compatible endpoint set AWS_ENDPOINT_URL and use s3://BUCKET[/PREFIX]",
    "gs": "Google Cloud Storage speaks S3 at https://storage.googleapis.com: set AWS_ENDPOINT_URL to it "
          "and use s3://BUCKET[/PREFIX]",
}


class BucketURLError(ValueError):
    """A bucket URL that names no usable bucket; the message says what to write instead."""


class BucketURL(NamedTuple):
    """A parsed bucket URL.

    ``scheme`` is ``file`` (``location`` is the directory), or ``s3``/``r2`` (``location`` is the bucket
    name, empty when the URL names none, and ``prefix`` the key prefix, possibly empty).
    """

    scheme: str
    location: str
    prefix: str = ""


def parse_bucket_url(url: str) -> BucketURL:
    """Parse a bucket URL; refuse an unknown form with a message naming the accepted ones.

    A plain path or ``file://DIR`` (``file://localhost/DIR`` too) is a directory; ``s3://BUCKET/PREFIX``
    and ``r2://BUCKET/PREFIX`` name a bucket and a key prefix. S3/R2 URLs take no query, fragment or
    credentials. Surrounding whitespace is ignored and the scheme is case-insensitive.

    Args:
        url: the bucket URL.

    A path that starts like a URL with fewer than two slashes (``s3:/bucket/x``) is refused rather than
    taken for a local directory; write ``./s3:/bucket/x`` to mean the directory.

    Args:
        url: the bucket URL.

    Raises:
        BucketURLError: (a ValueError) empty URL, unknown or malformed scheme, ``file://`` without a
            directory, a query or fragment, or credentials in the URL.
    """
    if not isinstance(url, str) or not url.strip():
        raise BucketURLError(f"empty bucket URL; expected {ACCEPTED_FORMS}")
    url = url.strip()
    if "://" not in url:
        malformed = _SCHEME_LIKE.match(url)
        if malformed:
            scheme, rest = malformed.group(1), url[malformed.end():].lstrip("/")
            raise BucketURLError(f"bucket URL {url!r} is malformed: a scheme takes two slashes "
                                 f"({scheme}://{rest}); for a local directory of that name write ./{url}")
        return BucketURL("file", url)
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme == "file":
        if rest.startswith("localhost/"):
            rest = rest[len("localhost") :]
        if not rest:
            raise BucketURLError(f"file:// URL without a directory; expected {ACCEPTED_FORMS}")
        return BucketURL("file", rest)
    if scheme not in ("s3", "r2"):
        hint = f"; {_SCHEME_HINTS[scheme]}" if scheme in _SCHEME_HINTS else ""
        raise BucketURLError(f"unsupported bucket URL scheme {scheme + '://'!r}; expected {ACCEPTED_FORMS}"
                             f"{hint}")
    bucket, _, prefix = rest.partition("/")
    if "@" in bucket or ":" in bucket:  # user:secret@bucket, or user:se/cret@bucket cut at the '/'
        raise BucketURLError("credentials in bucket URLs are refused (they would end up in logs); put them "
                             "in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or an env file (STOA_ENV_FILE)")
    if "?" in rest or "#" in rest:
        raise BucketURLError(f"bucket URLs take no query or fragment ('?' or '#'); expected {ACCEPTED_FORMS}")
    return BucketURL(scheme, bucket, prefix)
