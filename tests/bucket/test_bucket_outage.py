"""Outages: long time-bounded retry budgets, local directory failures as bucket errors, a patient bucket that
waits them out (idempotent create-only writes under retries), and secret scrubbing that keeps messages."""

from __future__ import annotations

import builtins
import errno
from pathlib import Path
from typing import Any

import pytest

import stoa.bucket.directory as local_mod
from stoa.bucket import AccessDenied, Bucket, BucketUnreachable, PatientBucket, RetryPolicy, open_bucket
from stoa.bucket.credentials import S3Credentials, scrub_secrets
from stoa.bucket.s3 import S3Bucket


class Flaky:
    """Wraps a bucket: the first ``fail`` calls of ``method`` raise BucketUnreachable; with ``land`` the call
    reaches the bucket first (the write happened, its response was lost)."""

    def __init__(self, inner: Bucket, method: str, fail: int, land: bool = False) -> None:
        self.inner, self.url, self.method, self.fail, self.land = inner, inner.url, method, fail, land
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.inner, name)
        if name != self.method:
            return fn

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls <= self.fail:
                if self.land:
                    fn(*args, **kwargs)
                raise BucketUnreachable("503 from the proxy (injected)")
            return fn(*args, **kwargs)

        return call


def _patient(inner: Any, **kw: Any) -> tuple[PatientBucket, list[str], list[float]]:
    notes: list[str] = []
    sleeps: list[float] = []
    return PatientBucket(inner, note=notes.append, sleep=sleeps.append, **kw), notes, sleeps


def test_patient_bucket_waits_out_failures_with_growing_jittered_pauses(tmp_path: Path) -> None:
    flaky = Flaky(open_bucket(str(tmp_path)), "get", fail=8)
    flaky.inner.put_create("k", b"v")
    bucket, notes, sleeps = _patient(flaky, base_wait_s=1.0, max_wait_s=16.0)
    assert bucket.get("k") == b"v"
    assert flaky.calls == 9 and bucket.outages == 1
    caps = [1, 2, 4, 8, 16, 16, 16, 16]
    assert len(sleeps) == 8 and all(lo / 2 <= s <= lo for s, lo in zip(sleeps, caps, strict=True))
    assert len(notes) == 9 and "answered again" in notes[-1] and "waiting" in notes[0]


def test_record_upload_whose_response_was_lost_is_neither_an_error_nor_a_duplicate(tmp_path: Path) -> None:
    inner = open_bucket(str(tmp_path))
    flaky = Flaky(inner, "put_create", fail=3, land=True)
    bucket, _, _ = _patient(flaky)
    key = "runs/r/rollouts/v00000001/w-1-0.rec"
    bucket.put_create(key, b"record bytes")
    assert flaky.calls == 4
    assert [o.key for o in inner.list("runs/r/rollouts/")] == [key] and inner.get(key) == b"record bytes"
    with pytest.raises(Exception, match="different object"):  # still create-only
        bucket.put_create(key, b"other bytes")


def test_exit_on_outage_raises_at_once(tmp_path: Path) -> None:
    flaky = Flaky(open_bucket(str(tmp_path)), "list", fail=1)
    bucket, _, sleeps = _patient(flaky, exit_on_outage=True)
    with pytest.raises(BucketUnreachable):
        list(bucket.list(""))
    assert sleeps == []


def test_listing_is_retried_whole(tmp_path: Path) -> None:
    inner = open_bucket(str(tmp_path))
    for k in ("a/1", "a/2", "a/3"):
        inner.put_create(k, b"x")
    bucket, _, _ = _patient(Flaky(inner, "list", fail=2))
    assert [o.key for o in bucket.list("a/")] == ["a/1", "a/2", "a/3"]


def _failing_open(monkeypatch: pytest.MonkeyPatch, code: int, times: int) -> list[int]:
    """Make the local bucket's reads fail with ``code`` for the first ``times`` opens."""
    seen: list[int] = []
    real = builtins.open

    def fake_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if "rb" == mode and len(seen) < times:
            seen.append(code)
            raise OSError(code, errno.errorcode[code] + " (injected)", str(file))
        return real(file, mode, *args, **kwargs)

    monkeypatch.setattr(local_mod, "open", fake_open, raising=False)
    return seen


def test_local_bucket_turns_an_unusable_directory_into_bucket_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = open_bucket(str(tmp_path))
    plain.put_create("k", b"v")
    _failing_open(monkeypatch, errno.EIO, 1)
    with pytest.raises(BucketUnreachable, match="EIO"):
        plain.get("k")
    _failing_open(monkeypatch, errno.EACCES, 1)
    with pytest.raises(AccessDenied):
        plain.get("k")
    monkeypatch.setattr(local_mod.time, "sleep", lambda s: None)
    patient = open_bucket(str(tmp_path), retry_seconds=60)
    seen = _failing_open(monkeypatch, errno.ESTALE, 5)
    assert patient.get("k") == b"v" and len(seen) == 5  # retried within the budget


def test_retry_budgets_are_time_bounded_and_configurable(tmp_path: Path) -> None:
    policy = RetryPolicy.for_budget(300)
    assert policy.total_timeout_s == 300 and policy.max_attempts > 10_000
    assert all(0 < policy.delay(n) <= 15 for n in (1, 5, 50, 10**6))
    env = {"AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": "x" * 40,
           "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "STOA_BUCKET_RETRY_TIMEOUT_S": "20"}
    assert open_bucket("s3://b/p", env)._retry.total_timeout_s == 20
    assert open_bucket("s3://b/p", env, retry_seconds=300)._retry.total_timeout_s == 300
    assert open_bucket(str(tmp_path), retry_seconds=300).retry.total_timeout_s == 300
    assert open_bucket(str(tmp_path)).retry is None


# -------------------------------------------------------------------------- scrubbing


def test_short_secrets_are_scrubbed_as_whole_tokens_only() -> None:
    msg = "status code: 503 Service Unavailable; sessions lost"
    assert scrub_secrets(msg, ["s"]) == msg
    assert scrub_secrets("http://user:s@host/x and key s.", ["s"]) == "http://user:***@host/x and key ***."
    assert scrub_secrets("token ab12 in ab123", ["ab12"]) == "token *** in ab123"


def test_long_secrets_are_scrubbed_everywhere_including_url_encoded() -> None:
    secret = "wJalrXUtnFEMI/K7MDENG+bPxRfiCY"
    text = f"sig{secret}x and {secret.replace('/', '%2F').replace('+', '%2B')}"
    out = scrub_secrets(text, [secret, "", "wJalrXUtnFEMI"])
    assert secret not in out and "%2F" not in out and "wJalrXUtnFEMI" not in out
    assert out == "sig***x and ***"


def test_s3_error_messages_with_a_one_letter_secret_stay_readable() -> None:
    creds = S3Credentials(access_key_id="AKIDEXAMPLE", secret_access_key="s", endpoint="http://u:p@127.0.0.1:9")
    bucket = S3Bucket("b", "p", credentials=creds)
    text = bucket._failures.short(RuntimeError("connection refused: status 503, retries s and p exhausted"))
    assert text == "RuntimeError: connection refused: status 503, retries *** and *** exhausted"
