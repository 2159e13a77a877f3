"""Bucket URLs parse into a scheme, a location and a prefix before any backend is built."""

from __future__ import annotations

import pytest

from stoa.bucket import (
    ACCEPTED_FORMS,
    BucketURL,
    BucketURLError,
    check_bucket_url,
    open_bucket,
    parse_bucket_url,
)


@pytest.mark.parametrize("url,parsed", [
    ("runs/dir", BucketURL("file", "runs/dir")),
    ("  /tmp/b  ", BucketURL("file", "/tmp/b")),
    ("file:///tmp/b", BucketURL("file", "/tmp/b")),
    ("FILE://localhost/tmp/b", BucketURL("file", "/tmp/b")),
    ("s3://bucket/runs/r1/", BucketURL("s3", "bucket", "runs/r1/")),
    ("S3://bucket", BucketURL("s3", "bucket", "")),
    ("r2:///runs", BucketURL("r2", "", "runs")),
    ("./s3:/bucket/x", BucketURL("file", "./s3:/bucket/x")),
    ("C:/runs", BucketURL("file", "C:/runs")),
])
def test_accepted_forms(url: str, parsed: BucketURL) -> None:
    assert parse_bucket_url(url) == parsed


@pytest.mark.parametrize("url,match", [
    ("", "empty bucket URL"),
    ("file://", "without a directory"),
    ("gs://bucket/x", "unsupported bucket URL scheme 'gs://'; expected .*; Google Cloud Storage speaks S3"),
    ("http://minio:9000/b", "unsupported bucket URL scheme 'http://'; expected .*; for an S3-compatible "
                            "endpoint set AWS_ENDPOINT_URL"),
    ("ftp://host/b", "unsupported bucket URL scheme 'ftp://'; expected"),
    ("s3://bucket/x#frag", "no query or fragment"),
    ("r2://bucket/x?versionId=1", "no query or fragment"),
    ("s3://key:secret@bucket/x", "credentials in bucket URLs are refused"),
    ("s3://key:se/cret@bucket/x", "credentials in bucket URLs are refused"),
    ("s3://key:secret@bucket/x?q=1", "credentials in bucket URLs are refused"),
    ("s3:/bucket/x", r"bucket URL 's3:/bucket/x' is malformed: a scheme takes two slashes "
                     r"\(s3://bucket/x\); for a local directory of that name write ./s3:/bucket/x"),
    ("r2:bucket", r"a scheme takes two slashes \(r2://bucket\)"),
])
def test_refused_forms_say_why(url: str, match: str) -> None:
    with pytest.raises(BucketURLError, match=match) as info:
        parse_bucket_url(url)
    assert "secret" not in str(info.value) and "cret" not in str(info.value)
    assert "\n" not in str(info.value)
    if "credentials" not in match and "two slashes" not in match:
        assert ACCEPTED_FORMS in str(info.value)


def test_a_file_is_not_a_bucket(tmp_path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("x")
    with pytest.raises(BucketURLError, match="is a file, not a directory"):
        open_bucket(str(f))
    assert f.read_text() == "x"


def test_a_missing_directory_is_refused_only_without_create(tmp_path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(BucketURLError, match=f"bucket directory {missing} does not exist; start the trainer"):
        open_bucket(str(missing), create=False)
    assert not missing.exists()
    check_bucket_url(str(missing))  # the trainer's case: fine, open_bucket creates it
    open_bucket(str(missing))
    assert missing.is_dir()
    assert check_bucket_url(f"file://{missing}", must_exist=True) == BucketURL("file", str(missing))
