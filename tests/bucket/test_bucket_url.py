"""Bucket URLs parse into a scheme, a location and a prefix before any backend is built."""

from __future__ import annotations

import pytest

from stoa.bucket import ACCEPTED_FORMS, BucketURL, parse_bucket_url


@pytest.mark.parametrize("url,parsed", [
    ("runs/dir", BucketURL("file", "runs/dir")),
    ("  /tmp/b  ", BucketURL("file", "/tmp/b")),
    ("file:///tmp/b", BucketURL("file", "/tmp/b")),
    ("FILE://localhost/tmp/b", BucketURL("file", "/tmp/b")),
    ("s3://bucket/runs/r1/", BucketURL("s3", "bucket", "runs/r1/")),
    ("S3://bucket", BucketURL("s3", "bucket", "")),
    ("r2:///runs", BucketURL("r2", "", "runs")),
])
def test_accepted_forms(url: str, parsed: BucketURL) -> None:
    assert parse_bucket_url(url) == parsed


@pytest.mark.parametrize("url,match", [
    ("", "empty bucket URL"),
    ("file://", "without a directory"),
    ("gs://bucket/x", "unsupported bucket URL scheme 'gs://'"),
    ("s3://bucket/x#frag", "no query or fragment"),
    ("r2://bucket/x?versionId=1", "no query or fragment"),
    ("s3://key:secret@bucket/x", "credentials in bucket URLs"),
])
def test_refused_forms_say_why(url: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        parse_bucket_url(url)
    assert "secret" not in str(info.value)
    if "credentials" not in match:
        assert ACCEPTED_FORMS in str(info.value)
