"""The fault proxy itself, and the S3 bucket layer riding out each fault kind it injects (moto on 127.0.0.1)."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request

import pytest

from stoa.bucket import BucketUnreachable, open_bucket
from tests.bucket.conftest import TEST_BUCKET, moto_env
from tests.faults.proxy import FAULT_KINDS, FaultProxy, FaultRates


def _bucket(endpoint: str, prefix: str, budget_s: float):
    env = {**moto_env(endpoint), "STOA_BUCKET_RETRY_TIMEOUT_S": str(budget_s)}
    return open_bucket(f"s3://{TEST_BUCKET}/{prefix}", env)


def _op(method: str, path: str) -> str:
    """create (PUT of a blob), cas (PUT of the pointer), read (GET/HEAD of an object), list."""
    if "list-type=" in path:
        return "list"
    if method == "PUT":
        return "cas" if path.endswith("/ptr") else "create"
    return "read"


# Per fault kind, the operations it must have hit at least once (the seed is fixed and the client is
# single-threaded, so the draws are the same on every run).
MUST_HIT = {"error_5xx": ("create", "cas", "read"), "latency": ("create", "read"), "cut_body": ("read", "list"),
            "drop_after_write": ("create", "cas")}


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_every_operation_survives_a_third_of_its_requests_faulting(moto_endpoint, kind):
    """At a 30% rate of one fault kind, create-only puts, CAS, reads and listings still return exact results."""
    with FaultProxy(moto_endpoint, FaultRates(**{kind: 0.3}, max_latency_s=0.05), seed=7, label=_op) as proxy:
        prefix = f"survive-{kind}"
        b = _bucket(proxy.url, prefix, budget_s=30)
        direct = _bucket(moto_endpoint, prefix, budget_s=5)
        blobs = {f"k{i}": bytes([i]) * (100 + i) for i in range(4)}
        for k, v in blobs.items():
            b.put_create(k, v)
            b.put_create(k, v)  # idempotent: the same bytes again are a success
        etag = None
        for i in range(6):
            etag = b.cas("ptr", f"v{i}".encode(), etag)  # a lost answer to a CAS that landed is a success
        for _ in range(3):
            assert [i.key for i in b.list("")] == sorted([*blobs, "ptr"])
        assert {k: b.get(k) for k in blobs} == blobs
        assert b.get_with_etag("ptr") == (b"v5", etag)
        assert {k: direct.get(k) for k in blobs} == blobs  # what the store really holds
        counts = proxy.counts()
    assert all(counts.get(f"{kind}@{op}", 0) >= 1 for op in MUST_HIT[kind]), counts
    assert {k.split("/")[0].split("@")[0] for k in counts} <= {"requests", kind}


def test_a_write_whose_answer_is_dropped_lands_and_the_client_sees_an_outage(moto_endpoint):
    """drop_after_write forwards the PUT before resetting: the store has the object, the client got no answer."""
    with FaultProxy(moto_endpoint, FaultRates(drop_after_write=1.0), seed=1) as proxy:
        b = _bucket(proxy.url, "dropped", budget_s=0.5)
        with pytest.raises(BucketUnreachable):
            b.put("k", b"landed")
        assert proxy.counts()["drop_after_write/PUT"] >= 1
    assert _bucket(moto_endpoint, "dropped", budget_s=5).get("k") == b"landed"


@pytest.mark.parametrize("kind", ["error_5xx", "cut_body"])
def test_a_read_that_always_faults_ends_in_bucket_unreachable(moto_endpoint, kind):
    """A cut body is never returned as data: the read fails as an outage once the budget is spent."""
    _bucket(moto_endpoint, f"always-{kind}", budget_s=5).put("k", b"x" * 1000)
    with FaultProxy(moto_endpoint, FaultRates(**{kind: 1.0}), seed=2) as proxy:
        with pytest.raises(BucketUnreachable):
            _bucket(proxy.url, f"always-{kind}", budget_s=1.5).get("k")
        assert proxy.counts()[f"{kind}/GET"] >= 2


def test_proxy_only_talks_to_loopback_and_stops_by_itself(moto_endpoint):
    for upstream in ("http://10.0.0.1:80", "http://example.com:80", "https://127.0.0.1:443", "http://127.0.0.1"):
        with pytest.raises(ValueError, match="loopback"):
            FaultProxy(upstream)
    proxy = FaultProxy(moto_endpoint, lifetime_s=0.5).start()
    port = int(proxy.url.rsplit(":", 1)[1])
    with urllib.request.urlopen(proxy.url + f"/{TEST_BUCKET}?list-type=2", timeout=5) as resp:
        assert resp.status == 200
    time.sleep(1.5)  # past its lifetime: the listening socket is closed
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    with pytest.raises(RuntimeError):
        _ = proxy.url


def test_proxy_refuses_oversize_bodies(moto_endpoint):
    with FaultProxy(moto_endpoint, max_body_bytes=1000) as proxy:
        req = urllib.request.Request(proxy.url + f"/{TEST_BUCKET}/big", data=b"x" * 2000, method="PUT")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=5)
        assert err.value.code == 413
