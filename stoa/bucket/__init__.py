"""The object-store bucket through which rollout workers and the trainer meet; open one with open_bucket."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .base import (
    AccessDenied,
    Bucket,
    BucketError,
    BucketUnreachable,
    ObjectExists,
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    validate_key,
)
from .credentials import CredentialsError, resolve_env, s3_credentials
from .directory import LocalBucket
from .outage import PatientBucket, RetryPolicy
from .url import ACCEPTED_FORMS, BucketURL, BucketURLError, parse_bucket_url

__all__ = [
    "ACCEPTED_FORMS",
    "AccessDenied",
    "Bucket",
    "BucketError",
    "BucketURL",
    "BucketURLError",
    "BucketUnreachable",
    "CredentialsError",
    "ObjectExists",
    "ObjectInfo",
    "ObjectNotFound",
    "PatientBucket",
    "PreconditionFailed",
    "RetryPolicy",
    "check_bucket_url",
    "open_bucket",
    "parse_bucket_url",
    "validate_key",
]

LISTING_VAR = "STOA_S3_LISTING"
RETRY_TIMEOUT_VAR = "STOA_BUCKET_RETRY_TIMEOUT_S"
CONNECT_TIMEOUT_VAR = "STOA_BUCKET_CONNECT_TIMEOUT_S"


def _float_var(env: Mapping[str, str], name: str, default: float) -> float:
    """A positive number of seconds from variable ``name`` (``default`` when unset or empty)."""
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {raw!r}")
    return value


def check_bucket_url(url: str, *, must_exist: bool = False) -> BucketURL:
    """Parse a bucket URL and check a local one against the file system, before anything is opened.

    Args:
        url: the bucket URL.
        must_exist: a local directory must already exist (a worker's: the trainer creates it).

    Raises:
        BucketURLError: (a ValueError) the URL is malformed (see ``parse_bucket_url``), a local path is
            a file, or ``must_exist`` and the directory does not exist; the message names the fix.
    """
    where = parse_bucket_url(url)
    if where.scheme != "file":
        return where
    path = os.path.expanduser(where.location)
    if os.path.exists(path) and not os.path.isdir(path):
        raise BucketURLError(f"bucket {url.strip()!r} is a file, not a directory; give a directory (a local "
                             f"bucket is a directory tree) or s3://BUCKET[/PREFIX]")
    if must_exist and not os.path.isdir(path):
        raise BucketURLError(f"bucket directory {os.path.abspath(path)} does not exist; start the trainer "
                             f"first (it creates it) or fix the --bucket path")
    return where


def open_bucket(
    url: str,
    env: Mapping[str, str] | None = None,
    *,
    env_file: str | os.PathLike[str] | None = None,
    retry_seconds: float | None = None,
    create: bool = True,
) -> Bucket:
    """Open a bucket from a URL.

    Forms: a plain directory path or ``file://DIR`` gives a LocalBucket rooted at DIR (created if
    missing, unless ``create`` is False); ``s3://BUCKET/PREFIX`` and ``r2://BUCKET/PREFIX`` give an
    S3Bucket whose keys live under PREFIX. For S3/R2 an empty BUCKET (``r2:///PREFIX``) means the
    R2_BUCKET (or AWS_BUCKET) variable.
    Credentials come from ``env`` (see stoa.bucket.credentials). Tuning variables read from ``env``:
    ``STOA_S3_LISTING`` ("server" or "client"), ``STOA_BUCKET_RETRY_TIMEOUT_S`` (default 20) and
    ``STOA_BUCKET_CONNECT_TIMEOUT_S`` (default 5).

    Args:
        url: Bucket URL.
        env: Variables to read (default ``os.environ``).
        env_file: A 0600 KEY=VALUE file to read too (default: the path in ``STOA_ENV_FILE``, if any);
            variables in ``env`` win over it.
        retry_seconds: Retry budget of one S3 operation (time-bounded, jittered exponential backoff);
            overrides ``STOA_BUCKET_RETRY_TIMEOUT_S``. Workers pass minutes here. A local bucket retries
            an unusable directory (EIO, ESTALE, full, read-only) within it; without it, it fails at once.
        create: create a missing local directory (the trainer's case); False refuses it (a worker's).

    Returns:
        The bucket.

    Raises:
        BucketURLError: (a ValueError) unknown or malformed URL, a local path that is a file, or a missing
            directory with ``create=False``; the message names the accepted forms or the fix.
        ValueError: invalid prefix or tuning variable.
        CredentialsError: S3/R2 credentials missing or env file unsafe; names the variables needed.
    """
    where = check_bucket_url(url, must_exist=not create)
    budget = RetryPolicy.for_budget(retry_seconds) if retry_seconds is not None else None
    if where.scheme == "file":

        return LocalBucket(where.location, retry=budget)
    return _s3_bucket(where, env, env_file, budget)


def _s3_bucket(where: BucketURL, env: Mapping[str, str] | None, env_file: str | os.PathLike[str] | None,
               budget: RetryPolicy | None) -> Bucket:
    """Build the S3Bucket of a parsed ``s3://``/``r2://`` URL from credentials and tuning variables.

    Args:
        where: the parsed URL (an empty bucket name means R2_BUCKET or AWS_BUCKET).
        env: variables to read (default ``os.environ``).
        env_file: a 0600 KEY=VALUE file to read too.
        budget: the retry policy of ``open_bucket(retry_seconds=...)``; None: ``STOA_BUCKET_RETRY_TIMEOUT_S``.
    """
    from .s3 import S3Bucket

    scheme, bucket = where.scheme, where.location
    variables = resolve_env(env, env_file)
    creds = s3_credentials(variables, scheme)
    if not bucket:
        bucket = creds.bucket or ""
        if not bucket:
            raise ValueError(f"{scheme}:// URL without a bucket name and R2_BUCKET/AWS_BUCKET unset")
    listing = variables.get(LISTING_VAR, "server") or "server"
    if listing not in ("server", "client"):
        raise ValueError(f"{LISTING_VAR} must be 'server' or 'client', got {listing!r}")
    retry = budget if budget is not None else RetryPolicy(
        total_timeout_s=_float_var(variables, RETRY_TIMEOUT_VAR, 20.0))
    return S3Bucket(
        bucket,
        where.prefix,
        credentials=creds,
        scheme=scheme,
        retry=retry,
        listing="client" if listing == "client" else "server",
        connect_timeout_s=_float_var(variables, CONNECT_TIMEOUT_VAR, 5.0),
    )
