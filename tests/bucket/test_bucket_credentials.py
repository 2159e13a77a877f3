"""URL parsing, credential resolution, the 0600 env-file rule, and secrets kept out of messages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stoa.bucket import BucketError, CredentialsError, open_bucket
from stoa.bucket.credentials import (
    S3Credentials,
    load_env_file,
    redact_url,
    resolve_env,
    s3_credentials,
)
from stoa.bucket.directory import LocalBucket
from stoa.bucket.s3 import S3Bucket

SECRET = "sk-test-DO-NOT-LEAK-8c2f41"


def _env_file(path: Path, text: str, mode: int) -> Path:
    path.write_text(text)
    os.chmod(path, mode)
    return path


# -------------------------------------------------------------------------- env file


def test_env_file_with_group_or_other_bits_is_refused(tmp_path: Path) -> None:
    for mode in (0o644, 0o640, 0o604, 0o666):
        f = _env_file(tmp_path / "r2.env", f"R2_SECRET_ACCESS_KEY={SECRET}\n", mode)
        with pytest.raises(CredentialsError) as info:
            load_env_file(f)
        message = str(info.value)
        assert str(f) in message
        assert f"{mode:04o}" in message
        assert "0600" in message
        assert SECRET not in message and SECRET not in repr(info.value)


def test_env_file_0600_and_0400_are_read(tmp_path: Path) -> None:
    text = "\n".join(
        [
            "# R2 for the run",
            "R2_ACCOUNT_ID=abc123",
            "export R2_ACCESS_KEY_ID = key-1",
            f'R2_SECRET_ACCESS_KEY="{SECRET}"',
            "R2_BUCKET='drl-bucket'",
            "",
            "EMPTY=",
        ]
    )
    for mode in (0o600, 0o400):
        f = _env_file(tmp_path / f"ok-{mode:o}.env", text, mode)
        assert load_env_file(f) == {
            "R2_ACCOUNT_ID": "abc123",
            "R2_ACCESS_KEY_ID": "key-1",
            "R2_SECRET_ACCESS_KEY": SECRET,
            "R2_BUCKET": "drl-bucket",
            "EMPTY": "",
        }


def test_env_file_malformed_line_names_line_not_content(tmp_path: Path) -> None:
    f = _env_file(tmp_path / "bad.env", f"A=1\n{SECRET} oops\n", 0o600)
    with pytest.raises(CredentialsError) as info:
        load_env_file(f)
    assert "line 2" in str(info.value)
    assert SECRET not in str(info.value)


def test_env_file_missing(tmp_path: Path) -> None:
    with pytest.raises(CredentialsError, match="does not exist"):
        load_env_file(tmp_path / "absent.env")


def test_resolve_env_reads_stoa_env_file_and_environment_wins(tmp_path: Path) -> None:
    f = _env_file(tmp_path / "s.env", "AWS_ACCESS_KEY_ID=from-file\nAWS_REGION=eu-west-1\n", 0o600)
    merged = resolve_env({"STOA_ENV_FILE": str(f), "AWS_ACCESS_KEY_ID": "from-env"})
    assert merged["AWS_ACCESS_KEY_ID"] == "from-env"
    assert merged["AWS_REGION"] == "eu-west-1"
    assert resolve_env({"X": "1"}, env_file=f)["AWS_REGION"] == "eu-west-1"
    loose = _env_file(tmp_path / "loose.env", "A=1\n", 0o644)
    with pytest.raises(CredentialsError):
        resolve_env({"STOA_ENV_FILE": str(loose)})


def test_open_bucket_with_unsafe_env_file_is_refused(tmp_path: Path) -> None:
    f = _env_file(
        tmp_path / "r2.env", f"R2_ACCOUNT_ID=a\nR2_ACCESS_KEY_ID=b\nR2_SECRET_ACCESS_KEY={SECRET}\n", 0o644
    )
    with pytest.raises(CredentialsError) as info:
        open_bucket("r2://bucket/run", {"STOA_ENV_FILE": str(f)})
    assert SECRET not in str(info.value)


# ----------------------------------------------------------------------- credentials


def test_r2_credentials_derive_endpoint_and_region() -> None:
    creds = s3_credentials(
        {
            "R2_ACCOUNT_ID": "acct42",
            "R2_ACCESS_KEY_ID": "key",
            "R2_SECRET_ACCESS_KEY": SECRET,
            "R2_BUCKET": "b",
        },
        "r2",
    )
    assert creds.endpoint == "https://acct42.r2.cloudflarestorage.com"
    assert creds.region == "auto"
    assert creds.bucket == "b"
    assert SECRET not in repr(creds) and SECRET not in str(creds)


def test_aws_credentials() -> None:
    creds = s3_credentials(
        {
            "AWS_ACCESS_KEY_ID": "AKIA",
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_SESSION_TOKEN": "token-secret-77",
            "AWS_DEFAULT_REGION": "eu-central-1",
            "AWS_ENDPOINT_URL": "http://generic:9000",
            "AWS_ENDPOINT_URL_S3": "http://s3-specific:9000",
        }
    )
    assert creds.endpoint == "http://s3-specific:9000"
    assert creds.region == "eu-central-1"
    assert creds.secrets() == (SECRET, "token-secret-77")
    assert "token-secret-77" not in repr(creds)
    # s3:// with only R2 variables uses them.
    assert (
        s3_credentials({"R2_ACCOUNT_ID": "a", "R2_ACCESS_KEY_ID": "k", "R2_SECRET_ACCESS_KEY": "s"}).region
        == "auto"
    )


def test_missing_credentials_name_the_variables() -> None:
    with pytest.raises(CredentialsError) as info:
        s3_credentials({})
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "R2_ACCOUNT_ID",
        "R2_ACCESS_KEY_ID",
        "STOA_ENV_FILE",
    ):
        assert name in str(info.value)
    with pytest.raises(CredentialsError) as info:
        s3_credentials({"R2_ACCOUNT_ID": "a", "R2_SECRET_ACCESS_KEY": SECRET}, "r2")
    assert "R2_ACCESS_KEY_ID" in str(info.value)
    assert SECRET not in str(info.value)
    with pytest.raises(CredentialsError, match="AWS_SECRET_ACCESS_KEY"):
        s3_credentials({"AWS_ACCESS_KEY_ID": "AKIA"})
    assert issubclass(CredentialsError, BucketError) and issubclass(CredentialsError, ValueError)


def test_open_bucket_without_credentials() -> None:
    with pytest.raises(CredentialsError, match="AWS_ACCESS_KEY_ID"):
        open_bucket("s3://bucket/prefix", {})


def test_redact_url() -> None:
    assert (
        redact_url("https://user:pw@host.example:8443/p?X-Amz-Signature=abc#f")
        == "https://host.example:8443/p"
    )
    assert redact_url("http://127.0.0.1:9000") == "http://127.0.0.1:9000"


def test_repr_of_bucket_and_credentials_hide_secrets() -> None:
    creds = S3Credentials(
        access_key_id="AKIAEXAMPLEKEY", secret_access_key=SECRET, session_token="tok-secret"
    )
    bucket = S3Bucket("b", "p", credentials=creds)
    for text in (repr(creds), str(creds), repr(bucket), str(bucket)):
        assert SECRET not in text and "tok-secret" not in text
    assert bucket.url == "s3://b/p"


# ------------------------------------------------------------------------- URL forms


def test_url_forms(tmp_path: Path) -> None:
    plain = open_bucket(str(tmp_path / "plain"), {})
    assert isinstance(plain, LocalBucket) and (tmp_path / "plain").is_dir()
    via_file = open_bucket(f"file://{tmp_path / 'viafile'}", {})
    assert isinstance(via_file, LocalBucket) and via_file.url == (tmp_path / "viafile").as_uri()
    env = {
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL": "http://127.0.0.1:1",
    }
    s3 = open_bucket("s3://my-bucket/runs/r1/", env)
    assert isinstance(s3, S3Bucket) and s3.url == "s3://my-bucket/runs/r1"
    assert open_bucket("s3://my-bucket", env).url == "s3://my-bucket"
    r2_env = {
        "R2_ACCOUNT_ID": "a",
        "R2_ACCESS_KEY_ID": "k",
        "R2_SECRET_ACCESS_KEY": SECRET,
        "R2_BUCKET": "drl",
    }
    assert open_bucket("r2:///runs", r2_env).url == "r2://drl/runs"
    assert open_bucket("r2://other/runs", r2_env).url == "r2://other/runs"


@pytest.mark.parametrize("url", ["gs://bucket/x", "http://host/bucket", "", "   ", "ftp://x"])
def test_unsupported_urls_name_accepted_forms(url: str) -> None:
    with pytest.raises(ValueError) as info:
        open_bucket(url, {})
    assert "s3://BUCKET" in str(info.value) and "file://DIR" in str(info.value)


def test_url_with_credentials_is_refused() -> None:
    with pytest.raises(ValueError) as info:
        open_bucket(f"s3://AKIA:{SECRET}@bucket/x", {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"})
    assert SECRET not in str(info.value)


def test_url_with_invalid_prefix_or_bucket() -> None:
    env = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    with pytest.raises(ValueError):
        open_bucket("s3://bucket/a/../b", env)
    with pytest.raises(ValueError):
        open_bucket("s3://bad bucket/x", env)
    with pytest.raises(ValueError):
        open_bucket("s3://bucket/x?versionId=1", env)
    with pytest.raises(ValueError, match="STOA_S3_LISTING"):
        open_bucket("s3://bucket/x", {**env, "STOA_S3_LISTING": "sorted"})
    with pytest.raises(ValueError, match="STOA_BUCKET_RETRY_TIMEOUT_S"):
        open_bucket("s3://bucket/x", {**env, "STOA_BUCKET_RETRY_TIMEOUT_S": "soon"})
