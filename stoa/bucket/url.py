"""Bucket URLs: the forms ``open_bucket`` accepts, parsed before any backend is built."""

from __future__ import annotations

from typing import NamedTuple

ACCEPTED_FORMS = "a directory path, file://DIR, s3://BUCKET[/PREFIX] or r2://BUCKET[/PREFIX]"


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

    Raises:
        ValueError: empty URL, unknown scheme, ``file://`` without a directory, a query or fragment, or
            credentials in the URL.
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"empty bucket URL; expected {ACCEPTED_FORMS}")
    url = url.strip()
    if "://" not in url:
        return BucketURL("file", url)
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme == "file":
        if rest.startswith("localhost/"):
            rest = rest[len("localhost") :]
        if not rest:
            raise ValueError(f"file:// URL without a directory; expected {ACCEPTED_FORMS}")
        return BucketURL("file", rest)
    if scheme not in ("s3", "r2"):
        raise ValueError(f"unsupported bucket URL scheme {scheme + '://'!r}; expected {ACCEPTED_FORMS}")
    if "?" in rest or "#" in rest:
        raise ValueError(f"bucket URLs take no query or fragment; expected {ACCEPTED_FORMS}")
    bucket, _, prefix = rest.partition("/")
    if "@" in bucket:
        raise ValueError(
            "credentials in bucket URLs are not accepted; use environment variables or an env file"
        )
    return BucketURL(scheme, bucket, prefix)
