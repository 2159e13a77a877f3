"""S3 backend specifics: retries, dead endpoints, multipart, listing modes, fork guard, SeaweedFS auth."""

from __future__ import annotations

import os
import pickle
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import obstore
import pytest
import xxhash
from obstore.exceptions import GenericError

from stoa.bucket import (
    AccessDenied,
    BucketError,
    BucketUnreachable,
    ObjectExists,
    ObjectNotFound,
    PreconditionFailed,
    open_bucket,
)
from stoa.bucket.credentials import s3_credentials
from stoa.bucket.s3 import RetryPolicy, S3Bucket

from .conftest import (
    MOTO_SECRET,
    SEAWEED_SECRET,
    TEST_BUCKET,
    Backend,
    Seaweed,
    closed_port,
    moto_env,
    seaweed_env,
)

MIB = 1 << 20


def _moto_bucket(endpoint: str, **kwargs: Any) -> S3Bucket:
    creds = s3_credentials(moto_env(endpoint))
    prefix = f"s3-{os.urandom(6).hex()}"
    return S3Bucket(TEST_BUCKET, prefix, credentials=creds, **kwargs)


def _transient(msg: str = "HTTP error: error sending request") -> GenericError:
    return GenericError(f"Generic S3 error: Error performing PUT http://example/x in 1ms - {msg}")


# ------------------------------------------------------------------ dead endpoint


def test_dead_endpoint_gives_bucket_unreachable_quickly() -> None:
    port = closed_port()
    env = {
        "AWS_ACCESS_KEY_ID": "AKIDEAD",
        "AWS_SECRET_ACCESS_KEY": "dead-endpoint-secret-0451",
        "AWS_ENDPOINT_URL": f"http://operator:hunter2@127.0.0.1:{port}/",
        "STOA_BUCKET_RETRY_TIMEOUT_S": "1",
    }
    bucket = open_bucket("s3://stoa-test/runs", env)
    for call in (
        lambda: bucket.get("x"),
        lambda: bucket.put_create("x", b"1"),
        lambda: list(bucket.list("")),
        lambda: bucket.cas("x", b"1", None),
    ):
        started = time.monotonic()
        with pytest.raises(BucketUnreachable) as info:
            call()
        elapsed = time.monotonic() - started
        assert elapsed < 5, elapsed
        message = str(info.value)
        assert f"127.0.0.1:{port}" in message
        assert "s3://stoa-test/runs" in message
        for secret in ("dead-endpoint-secret-0451", "hunter2"):
            assert secret not in message
            assert secret not in repr(info.value)
            assert secret not in repr(bucket)


def test_default_retry_budget_is_bounded() -> None:
    policy = RetryPolicy()
    assert policy.total_timeout_s <= 20
    assert all(0 < policy.delay(n) <= policy.max_backoff_s for n in range(1, 30))


# ------------------------------------------------------------------------ retries


@pytest.fixture
def fast_retry() -> RetryPolicy:
    return RetryPolicy(total_timeout_s=5, initial_backoff_s=0.01, max_backoff_s=0.05)


def test_transient_errors_are_retried(
    moto_endpoint: str, fast_retry: RetryPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = _moto_bucket(moto_endpoint, retry=fast_retry)
    real_put = obstore.put
    calls = {"n": 0}

    def flaky_put(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] <= 2:
            raise _transient("Server returned non-2xx status code: 503 Service Unavailable")
        return real_put(*args, **kwargs)

    monkeypatch.setattr(obstore, "put", flaky_put)
    bucket.put("k", b"v")
    assert calls["n"] == 3
    assert bucket.get("k") == b"v"


def test_client_errors_are_not_retried(
    moto_endpoint: str, fast_retry: RetryPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = _moto_bucket(moto_endpoint, retry=fast_retry)
    calls = {"n": 0}

    def bad_request(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        raise _transient("Server returned non-2xx status code: 400 Bad Request: <Code>InvalidRequest</Code>")

    monkeypatch.setattr(obstore, "put", bad_request)
    with pytest.raises(BucketError) as info:
        bucket.put("k", b"v")
    assert not isinstance(info.value, BucketUnreachable)
    assert calls["n"] == 1


def _lands_then_fails(real_put: Any, times: int = 1) -> Any:
    """A put that reaches the store but whose response is 'lost' for the first ``times`` calls."""
    calls = {"n": 0}

    def put(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        result = real_put(*args, **kwargs)
        if calls["n"] <= times:
            raise _transient("HTTP error: connection reset by peer")
        return result

    return put


def test_put_create_lost_response_is_idempotent(
    moto_endpoint: str, fast_retry: RetryPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = _moto_bucket(moto_endpoint, retry=fast_retry)
    monkeypatch.setattr(obstore, "put", _lands_then_fails(obstore.put))
    bucket.put_create("rec", b"mine")  # the retry finds our own bytes: success
    assert bucket.get("rec") == b"mine"


def test_cas_lost_response_is_recognised(
    moto_endpoint: str, fast_retry: RetryPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = _moto_bucket(moto_endpoint, retry=fast_retry)
    e1 = bucket.cas("ptr", b"v1", None)
    monkeypatch.setattr(obstore, "put", _lands_then_fails(obstore.put))
    e2 = bucket.cas("ptr", b"v2", e1)
    assert bucket.get_with_etag("ptr") == (b"v2", e2)
    e3 = bucket.cas("ptr2", b"new", None)
    assert bucket.get_with_etag("ptr2") == (b"new", e3)


def test_cas_without_lost_response_does_not_accept_equal_content(moto_endpoint: str) -> None:
    """Two writers both computing 0 -> 1 must not both succeed (a counter would lose an increment)."""
    bucket = _moto_bucket(moto_endpoint)
    e0 = bucket.cas("counter", b"0", None)
    bucket.cas("counter", b"1", e0)
    with pytest.raises(PreconditionFailed):
        bucket.cas("counter", b"1", e0)


# --------------------------------------------------------------------- multipart


def test_multipart_put_file_round_trip(moto_endpoint: str, tmp_path: Path) -> None:
    bucket = _moto_bucket(moto_endpoint, part_size=5 * MIB)
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(11 * MIB + 123))
    bucket.put_file("ckpt/model.safetensors", src, create_only=False)
    info = next(bucket.list("ckpt/"))
    assert info.size == src.stat().st_size
    assert info.etag is not None and info.etag.strip('"').endswith("-3")  # three parts
    dest = tmp_path / "dest.bin"
    bucket.get_file("ckpt/model.safetensors", dest)
    assert xxhash.xxh3_128_hexdigest(dest.read_bytes()) == xxhash.xxh3_128_hexdigest(src.read_bytes())
    other = tmp_path / "other.bin"
    other.write_bytes(b"other")
    with pytest.raises(ObjectExists):
        bucket.put_file("ckpt/model.safetensors", other)
    bucket.put_file("ckpt/model.safetensors", src)  # create_only, identical: success without upload


def test_large_unconditional_put_uses_multipart(moto_endpoint: str) -> None:
    bucket = _moto_bucket(moto_endpoint, part_size=5 * MIB)
    data = os.urandom(21 * MIB)
    bucket.put("big", data)
    assert bucket.get("big") == data
    assert bucket.get_range("big", 20 * MIB, 22 * MIB) == data[20 * MIB :]


def _write_random_file(path: Path, size: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    h = xxhash.xxh3_128()
    chunk = 16 * MIB
    with open(path, "wb") as f:
        for offset in range(0, size, chunk):
            block = rng.integers(0, 256, size=min(chunk, size - offset), dtype=np.uint8).tobytes()
            h.update(block)
            f.write(block)
    return h.hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("create_only", [False, True], ids=["overwrite", "create-only"])
def test_200mib_round_trip(backend: Backend, tmp_path: Path, create_only: bool) -> None:
    bucket = backend.open()
    src = tmp_path / "src.bin"
    size = 200 * MIB + 7
    digest = _write_random_file(src, size, seed=200)
    bucket.put_file("anchors/v1/model.safetensors", src, create_only=create_only)
    dest = tmp_path / "dest.bin"
    bucket.get_file("anchors/v1/model.safetensors", dest)
    assert dest.stat().st_size == size
    h = xxhash.xxh3_128()
    with open(dest, "rb") as f:
        while block := f.read(16 * MIB):
            h.update(block)
    assert h.hexdigest() == digest
    assert bucket.get_range("anchors/v1/model.safetensors", size - 7, size + 100) == src.read_bytes()[-7:]


# ------------------------------------------------------------------- environment


def test_obstore_ignores_aws_variables_in_os_environ(
    moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong")
    bucket = open_bucket(f"s3://{TEST_BUCKET}/env-{os.urandom(4).hex()}", moto_env(moto_endpoint))
    bucket.put_create("k", b"v")
    assert bucket.get("k") == b"v"


def test_missing_bucket_is_not_object_not_found(moto_endpoint: str) -> None:
    bucket = open_bucket("s3://no-such-bucket-4c1e/x", moto_env(moto_endpoint))
    # exists() is a HEAD, whose 404 has no body to tell a missing bucket from a missing key.
    for call in (
        lambda: bucket.get("k"),
        lambda: bucket.put_create("k", b"v"),
        lambda: list(bucket.list("")),
    ):
        with pytest.raises(BucketError) as info:
            call()
        assert not isinstance(info.value, ObjectNotFound)
        assert "does not exist" in str(info.value)


def test_r2_url_with_r2_variables(moto_endpoint: str) -> None:
    env = {
        "R2_ACCOUNT_ID": "0123456789abcdef",
        "R2_ACCESS_KEY_ID": "r2-key",
        "R2_SECRET_ACCESS_KEY": "r2-fake-secret-99",
        "R2_BUCKET": TEST_BUCKET,
        "R2_ENDPOINT_URL": moto_endpoint,
    }
    bucket = open_bucket(f"r2:///r2-{os.urandom(4).hex()}", env)
    assert bucket.url.startswith(f"r2://{TEST_BUCKET}/r2-")
    bucket.put_create("k", b"v")
    assert bucket.get("k") == b"v"
    assert "r2-fake-secret-99" not in repr(bucket)


def test_bucket_pickles_without_a_store(moto_endpoint: str) -> None:
    bucket = _moto_bucket(moto_endpoint)
    bucket.put("k", b"v")
    clone = pickle.loads(pickle.dumps(bucket))
    assert clone.get("k") == b"v"


def test_fork_after_use_fails_fast_instead_of_hanging(moto_endpoint: str) -> None:
    bucket = _moto_bucket(moto_endpoint)
    bucket.put("k", b"v")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 3
        try:
            signal.alarm(10)
            bucket.get("k")
            code = 1
        except BucketError as exc:
            code = 0 if "spawn" in str(exc) else 2
        except BaseException:
            code = 4
        finally:
            os.write(write_fd, bytes([code]))
            os._exit(0)
    os.close(write_fd)
    try:
        result = os.read(read_fd, 1)
    finally:
        os.close(read_fd)
        os.waitpid(pid, 0)
    assert result == bytes([0])


# --------------------------------------------------------------------- SeaweedFS


@pytest.fixture
def seaweed_bucket_url() -> str:
    return f"s3://{TEST_BUCKET}/sw-{os.urandom(6).hex()}"


@pytest.mark.seaweedfs
def test_seaweedfs_refuses_wrong_credentials(seaweed: Seaweed, seaweed_bucket_url: str) -> None:
    env = {**seaweed_env(seaweed.endpoint), "AWS_SECRET_ACCESS_KEY": "wrong-secret-5e8f"}
    bucket = open_bucket(seaweed_bucket_url, env)
    started = time.monotonic()
    for call in (
        lambda: bucket.put_create("k", b"v"),
        lambda: bucket.get("k"),
        lambda: list(bucket.list("")),
    ):
        with pytest.raises(AccessDenied) as info:
            call()
        assert "wrong-secret-5e8f" not in str(info.value)
        assert SEAWEED_SECRET not in str(info.value)
    assert time.monotonic() - started < 5  # refused credentials are not retried
    good = open_bucket(seaweed_bucket_url, seaweed_env(seaweed.endpoint))
    assert not good.exists("k")


@pytest.mark.seaweedfs
def test_seaweedfs_server_listing_fails_closed(seaweed: Seaweed, seaweed_bucket_url: str) -> None:
    """weed lists in directory-tree order; 'server' listing mode must notice rather than mis-order."""
    env = {**seaweed_env(seaweed.endpoint), "STOA_S3_LISTING": "server"}
    bucket = open_bucket(seaweed_bucket_url, env)
    for k in ["o/a/c", "o/a-b"]:
        bucket.put_create(k, b"x")
    with pytest.raises(BucketError, match="lexicographic"):
        list(bucket.list(""))
    client = open_bucket(seaweed_bucket_url, seaweed_env(seaweed.endpoint))
    assert [i.key for i in client.list("")] == ["o/a-b", "o/a/c"]


def test_secret_never_in_moto_errors(moto_endpoint: str) -> None:
    bucket = open_bucket(f"s3://{TEST_BUCKET}/sec-{os.urandom(4).hex()}", moto_env(moto_endpoint))
    errors: list[BaseException] = []
    for call in (
        lambda: bucket.get("missing"),
        lambda: bucket.cas("missing", b"x", '"stale"'),
        lambda: (bucket.put_create("k", b"1"), bucket.put_create("k", b"2")),
    ):
        try:
            call()
        except BucketError as exc:
            errors.append(exc)
    assert len(errors) == 3
    for exc in errors:
        assert MOTO_SECRET not in str(exc) and MOTO_SECRET not in repr(exc)
    assert MOTO_SECRET not in repr(bucket) and MOTO_SECRET not in str(bucket)
