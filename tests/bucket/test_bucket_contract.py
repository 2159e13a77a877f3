"""The Bucket contract, run against every backend (local dir, moto, SeaweedFS)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stoa.bucket import (
    Bucket,
    BucketError,
    ObjectExists,
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
)

from ._workers import KILL_WRITER, race_create
from .conftest import Backend

# Keys whose lexicographic order differs from directory-tree order ('-' and '.' sort before '/').
TRICKY_KEYS = ["o/a/c", "o/a/d", "o/a-b", "o/a.b", "o/ab", "o/b", "oz", "p/x", "o/a b/ü", "o/~"]


def keys(infos: object) -> list[str]:
    return [i.key for i in infos]  # type: ignore[attr-defined]


# ------------------------------------------------------------------ create / put / get


def test_put_create_then_get(bucket: Bucket) -> None:
    bucket.put_create("runs/r1/run.json", b'{"n": 8}')
    assert bucket.get("runs/r1/run.json") == b'{"n": 8}'
    assert bucket.exists("runs/r1/run.json")
    assert not bucket.exists("runs/r1/other.json")
    data, etag = bucket.get_with_etag("runs/r1/run.json")
    assert data == b'{"n": 8}' and etag


def test_put_create_identical_retry_succeeds_different_fails(bucket: Bucket) -> None:
    bucket.put_create("rec/a", b"payload-1")
    bucket.put_create("rec/a", b"payload-1")  # a retry whose first response was lost
    with pytest.raises(ObjectExists):
        bucket.put_create("rec/a", b"payload-2")
    with pytest.raises(ObjectExists):
        bucket.put_create("rec/a", b"payload-1-longer")
    assert bucket.get("rec/a") == b"payload-1"


def test_put_create_empty_object(bucket: Bucket) -> None:
    bucket.put_create("empty", b"")
    bucket.put_create("empty", b"")
    assert bucket.get("empty") == b""
    assert [(i.key, i.size) for i in bucket.list("")] == [("empty", 0)]


def test_put_overwrites(bucket: Bucket) -> None:
    bucket.put("ckpt/state", b"one")
    bucket.put("ckpt/state", b"two")
    assert bucket.get("ckpt/state") == b"two"


def test_missing_object(bucket: Bucket) -> None:
    with pytest.raises(ObjectNotFound):
        bucket.get("nope")
    with pytest.raises(ObjectNotFound):
        bucket.get_with_etag("nope")
    with pytest.raises(ObjectNotFound):
        bucket.get_if_changed("nope", "etag")
    with pytest.raises(ObjectNotFound):
        bucket.get_range("nope", 0, 4)
    with pytest.raises(ObjectNotFound):
        bucket.get_range("nope", 0, 0)
    bucket.delete("nope")  # missing is fine
    assert not bucket.exists("nope")


def test_unusual_key_characters_round_trip(bucket: Bucket) -> None:
    for key in ["a b/c+d=e,f@g~h", "ü/日本/x", "a%20b", "x/.hidden", "q!$&'()*;:"]:
        bucket.put_create(key, key.encode())
        assert bucket.get(key) == key.encode()
    listed = keys(bucket.list(""))
    assert listed == sorted(listed)
    assert set(listed) == {"a b/c+d=e,f@g~h", "ü/日本/x", "a%20b", "x/.hidden", "q!$&'()*;:"}


# ----------------------------------------------------------------------- CAS / etags


def test_cas_create_update_and_stale(bucket: Bucket) -> None:
    e1 = bucket.cas("weights/current.json", b"v1", None)
    assert bucket.get_with_etag("weights/current.json") == (b"v1", e1)
    with pytest.raises(PreconditionFailed):
        bucket.cas("weights/current.json", b"v1-again", None)  # must not exist
    e2 = bucket.cas("weights/current.json", b"v2", e1)
    assert e2 != e1
    assert bucket.get_with_etag("weights/current.json") == (b"v2", e2)
    with pytest.raises(PreconditionFailed):
        bucket.cas("weights/current.json", b"v3", e1)  # stale
    assert bucket.get("weights/current.json") == b"v2"


def test_cas_on_missing_key_with_etag_fails(bucket: Bucket) -> None:
    e = bucket.cas("k", b"x", None)
    bucket.delete("k")
    with pytest.raises(PreconditionFailed):
        bucket.cas("k", b"y", e)
    assert not bucket.exists("k")


def test_cas_create_rejects_existing_put_create(bucket: Bucket) -> None:
    bucket.put_create("k", b"x")
    with pytest.raises(PreconditionFailed):
        bucket.cas("k", b"x", None)


def test_etags_consistent_across_calls(bucket: Bucket) -> None:
    bucket.put("p", b"content")
    _, e1 = bucket.get_with_etag("p")
    _, e2 = bucket.get_with_etag("p")
    assert e1 == e2
    e3 = bucket.cas("p", b"content-2", e1)
    assert bucket.get_with_etag("p")[1] == e3


def test_get_if_changed(bucket: Bucket) -> None:
    bucket.put("ptr", b"v1")
    data, etag = bucket.get_with_etag("ptr")
    assert bucket.get_if_changed("ptr", etag) is None
    assert bucket.get_if_changed("ptr", None) == (b"v1", etag)
    bucket.put("ptr", b"v2")
    changed = bucket.get_if_changed("ptr", etag)
    assert changed is not None
    assert changed[0] == b"v2" and changed[1] != etag
    assert bucket.get_if_changed("ptr", changed[1]) is None


# ------------------------------------------------------------------------ ranged reads


def test_get_range(bucket: Bucket) -> None:
    data = bytes(range(256)) * 4
    bucket.put_create("blob", data)
    assert bucket.get_range("blob", 0, 3) == data[0:3]
    assert bucket.get_range("blob", 100, 612) == data[100:612]
    assert bucket.get_range("blob", 1000, 5000) == data[1000:]  # clipped at the end
    assert bucket.get_range("blob", 1024, 2000) == b""  # starts at the end
    assert bucket.get_range("blob", 4096, 5000) == b""  # starts past the end
    assert bucket.get_range("blob", 7, 7) == b""
    with pytest.raises(ValueError):
        bucket.get_range("blob", 5, 4)
    with pytest.raises(ValueError):
        bucket.get_range("blob", -1, 4)


# ----------------------------------------------------------------------------- listing


def test_list_sorted_string_prefix_and_start_after(bucket: Bucket) -> None:
    for k in TRICKY_KEYS:
        bucket.put_create(k, k.encode())
    expected_all = sorted(TRICKY_KEYS)
    assert keys(bucket.list("")) == expected_all
    probes = [
        None,
        "",
        "o",
        "o/",
        "o/a",
        "o/a-",
        "o/a.b",
        "o/a/",
        "o/a/c",
        "o/a/z",
        "o/b",
        "oa",
        "zz",
    ] + TRICKY_KEYS
    for prefix in ["", "o/", "o/a", "o/a/", "o/a-", "o/a b", "oz", "p/", "q", "o/~"]:
        for start_after in probes:
            want = [
                k for k in expected_all if k.startswith(prefix) and (start_after is None or k > start_after)
            ]
            assert keys(bucket.list(prefix, start_after)) == want, (prefix, start_after)


def test_list_reports_sizes(bucket: Bucket) -> None:
    bucket.put_create("s/one", b"1")
    bucket.put_create("s/three", b"333")
    infos = list(bucket.list("s/"))
    assert [(i.key, i.size) for i in infos] == [("s/one", 1), ("s/three", 3)]
    assert all(isinstance(i, ObjectInfo) for i in infos)


def test_list_pagination_over_1000_keys(bucket: Bucket) -> None:
    names = [f"rollouts/v{v:08d}/w{i:05d}" for v in (41, 42) for i in range(550)]
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda k: bucket.put_create(k, b"r"), names))
    bucket.put_create("rollouts/v00000043-other", b"x")
    all_keys = keys(bucket.list("rollouts/v0000004"))
    assert all_keys == sorted(names) + ["rollouts/v00000043-other"]
    assert keys(bucket.list("rollouts/v00000042/")) == sorted(names)[550:]
    after = sorted(names)[700]
    assert keys(bucket.list("rollouts/", start_after=after)) == sorted(names)[701:] + [
        "rollouts/v00000043-other"
    ]
    assert keys(bucket.list("rollouts/v00000041/", start_after=sorted(names)[-1])) == []


# ------------------------------------------------------------------------------ delete


def test_delete_and_delete_prefix(bucket: Bucket) -> None:
    for k in ["d/a/1", "d/a/2", "d/ab", "d/b/1", "e/1"]:
        bucket.put_create(k, b"x")
    bucket.delete("d/a/1")
    assert not bucket.exists("d/a/1")
    assert bucket.delete_prefix("d/a") == 2  # string prefix: d/a/2 and d/ab
    assert keys(bucket.list("")) == ["d/b/1", "e/1"]
    assert bucket.delete_prefix("d/") == 1
    assert bucket.delete_prefix("nothing/") == 0
    assert keys(bucket.list("")) == ["e/1"]
    bucket.put_create("d/a/1", b"again")  # a deleted key can be created again
    assert bucket.get("d/a/1") == b"again"


# -------------------------------------------------------------------------------- files


def test_put_file_get_file_round_trip(bucket: Bucket, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(300_000))
    bucket.put_file("files/a.bin", src)
    bucket.put_file("files/a.bin", src)  # identical: idempotent
    dest = tmp_path / "out" / "a.bin"
    dest.parent.mkdir()
    bucket.get_file("files/a.bin", dest)
    assert dest.read_bytes() == src.read_bytes()
    assert [p.name for p in dest.parent.iterdir()] == ["a.bin"]  # no temp file left

    other = tmp_path / "other.bin"
    other.write_bytes(b"different")
    with pytest.raises(ObjectExists):
        bucket.put_file("files/a.bin", other)
    bucket.put_file("files/a.bin", other, create_only=False)
    assert bucket.get("files/a.bin") == b"different"

    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    bucket.put_file("files/empty", empty)
    bucket.get_file("files/empty", dest)
    assert dest.read_bytes() == b""


def test_get_file_missing(bucket: Bucket, tmp_path: Path) -> None:
    out = tmp_path / "downloads"
    out.mkdir()
    with pytest.raises(ObjectNotFound):
        bucket.get_file("missing", out / "x")
    assert list(out.iterdir()) == []


# --------------------------------------------------------------------- key validation

BAD_KEYS = [
    "",
    "/abs",
    "a/../b",
    "..",
    "a/./b",
    "a\\b",
    "a//b",
    "trailing/",
    "ctl\x00",
    "tab\tkey",
    ".stoa/tmp/x",
    "x" * 1025,
]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_invalid_keys_rejected(bucket: Bucket, key: str) -> None:
    with pytest.raises(ValueError):
        bucket.put_create(key, b"x")
    with pytest.raises(ValueError):
        bucket.get(key)
    with pytest.raises(ValueError):
        bucket.cas(key, b"x", None)
    with pytest.raises(ValueError):
        bucket.exists(key)


@pytest.mark.parametrize("prefix", ["/x", "a/../", "a\\b", "/"])
def test_invalid_prefixes_rejected(bucket: Bucket, prefix: str) -> None:
    with pytest.raises(ValueError):
        list(bucket.list(prefix))


# ------------------------------------------------------------------------ concurrency


def test_create_race_between_processes_has_one_winner(backend: Backend) -> None:
    url = backend.fresh_url()
    ctx = multiprocessing.get_context("spawn")
    n = 6
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    payloads = [f"racer-{i}-".encode() * (i + 1) for i in range(n)]
    procs = [
        ctx.Process(target=race_create, args=(url, backend.env, "contended", p, barrier, results))
        for p in payloads
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert all(o in ("won", "exists") for _, o in outcomes), outcomes
    winners = [payload for payload, o in outcomes if o == "won"]
    assert len(winners) == 1, outcomes
    assert backend.open(url).get("contended") == winners[0]


def test_cas_contention_between_threads_loses_no_update(bucket: Bucket) -> None:
    bucket.cas("counter", b"0", None)

    def bump(_: int) -> int:
        retries = 0
        while True:
            data, etag = bucket.get_with_etag("counter")
            try:
                bucket.cas("counter", str(int(data) + 1).encode(), etag)
                return retries
            except PreconditionFailed:
                retries += 1

    with ThreadPoolExecutor(4) as ex:
        list(ex.map(bump, range(20)))
    assert bucket.get("counter") == b"20"


# --------------------------------------------------------------------------- SIGKILL


def _kill_mid_write(backend: Backend, tmp_path: Path, mode: str, size: int) -> None:
    url = backend.fresh_url()
    source = str(size)
    if mode.startswith("put_file"):
        big = tmp_path / "big.bin"
        with open(big, "wb") as f:
            f.truncate(size)  # sparse: instant to make, reads as zeros
        source = str(big)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_WRITER, url, json.dumps(backend.env), mode, "victim", source],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == b"start", proc.stderr.read() if proc.stderr else line
        if backend.name == "local":
            tmp_dir = Path(url) / ".stoa" / "tmp"
            deadline = time.monotonic() + 30
            while not any(tmp_dir.iterdir()) and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.001)
        else:
            time.sleep(0.4)
        assert proc.poll() is None, "the writer finished before it could be killed; make the object bigger"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    bucket = backend.open(url)
    assert not bucket.exists("victim")
    assert keys(bucket.list("")) == []
    with pytest.raises(ObjectNotFound):
        bucket.get_range("victim", 0, 1)
    bucket.put_create("victim", b"after the crash")  # nothing left blocks the key
    assert bucket.get("victim") == b"after the crash"


@pytest.mark.parametrize("mode", ["put_create", "put", "put_file", "put_file_create"])
def test_sigkill_during_put_leaves_no_object(backend: Backend, tmp_path: Path, mode: str) -> None:
    _kill_mid_write(backend, tmp_path, mode, 768 << 20)


# ------------------------------------------------------------------ backend specifics


def test_key_as_object_and_prefix(backend: Backend) -> None:
    """S3 keys are flat; local dirs and SeaweedFS (a filer tree) cannot hold both 'a' and 'a/b'."""
    bucket = backend.open()
    bucket.put_create("a/b", b"child")
    if backend.name == "moto":
        bucket.put_create("a", b"parent")
        assert keys(bucket.list("")) == ["a", "a/b"]
        return
    with pytest.raises(BucketError) as info:
        bucket.put_create("a", b"parent")
    assert not isinstance(info.value, ObjectExists)
    assert "prefix" in str(info.value) or "conflicts" in str(info.value)
    assert keys(bucket.list("")) == ["a/b"]
    assert not bucket.exists("a")
