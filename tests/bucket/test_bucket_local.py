"""Local backend specifics: hidden temp/lock files, path conflicts, pruning, stale temp sweeping."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from stoa.bucket import BucketError, ObjectExists
from stoa.bucket.directory import LocalBucket


def test_internal_files_are_never_listed(tmp_path: Path) -> None:
    bucket = LocalBucket(tmp_path / "b")
    bucket.put_create("a", b"1")
    bucket.cas("b", b"2", None)
    (tmp_path / "b" / ".stoa" / "tmp" / "leftover.part").write_bytes(b"partial")
    assert [i.key for i in bucket.list("")] == ["a", "b"]
    assert [i.key for i in bucket.list(".st")] == []
    assert (tmp_path / "b" / ".stoa" / "locks").is_dir()


def test_dot_files_outside_the_reserved_dir_are_objects(tmp_path: Path) -> None:
    bucket = LocalBucket(tmp_path / "b")
    bucket.put_create("runs/.marker", b"1")
    bucket.put_create(".stoarc", b"2")
    assert [i.key for i in bucket.list("")] == [".stoarc", "runs/.marker"]


def test_path_conflicts_raise_bucket_error(tmp_path: Path) -> None:
    bucket = LocalBucket(tmp_path / "b")
    bucket.put_create("a/b", b"child")
    bucket.put_create("x", b"file")
    for call in (
        lambda: bucket.put_create("a", b"p"),
        lambda: bucket.put("a", b"p"),
        lambda: bucket.cas("a", b"p", None),
        lambda: bucket.put_create("x/y", b"c"),
        lambda: bucket.put("x/y", b"c"),
    ):
        with pytest.raises(BucketError, match="conflicts") as info:
            call()
        assert not isinstance(info.value, ObjectExists)
    assert [i.key for i in bucket.list("")] == ["a/b", "x"]


def test_delete_prunes_empty_directories(tmp_path: Path) -> None:
    root = tmp_path / "b"
    bucket = LocalBucket(root)
    bucket.put_create("runs/r1/rollouts/v1/w-0", b"x")
    bucket.put_create("runs/r1/run.json", b"{}")
    bucket.delete("runs/r1/rollouts/v1/w-0")
    assert not (root / "runs" / "r1" / "rollouts").exists()
    assert (root / "runs" / "r1" / "run.json").exists()
    bucket.put_create("runs/r1/rollouts", b"now a file")  # the prefix is free again
    assert bucket.delete_prefix("") == 2
    assert sorted(p.name for p in root.iterdir()) == [".stoa"]


def test_stale_temp_files_are_swept_on_open(tmp_path: Path) -> None:
    root = tmp_path / "b"
    LocalBucket(root)
    tmp_dir = root / ".stoa" / "tmp"
    old = tmp_dir / "old.part"
    fresh = tmp_dir / "fresh.part"
    old.write_bytes(b"x")
    fresh.write_bytes(b"y")
    week_ago = time.time() - 7 * 24 * 3600
    os.utime(old, (week_ago, week_ago))
    LocalBucket(root)
    assert not old.exists()
    assert fresh.exists()  # may belong to a writer that is still running


def test_writes_leave_no_temp_files(tmp_path: Path) -> None:
    root = tmp_path / "b"
    bucket = LocalBucket(root)
    src = tmp_path / "src"
    src.write_bytes(b"file")
    bucket.put_create("a", b"1")
    bucket.put_create("a", b"1")
    with pytest.raises(ObjectExists):
        bucket.put_create("a", b"2")
    bucket.put("b", b"1")
    e = bucket.cas("c", b"1", None)
    bucket.cas("c", b"2", e)
    bucket.put_file("d", src)
    bucket.put_file("d", src, create_only=False)
    assert list((root / ".stoa" / "tmp").iterdir()) == []


def test_etag_is_content_digest(tmp_path: Path) -> None:
    a = LocalBucket(tmp_path / "a")
    b = LocalBucket(tmp_path / "b")
    a.put("k", b"same")
    b.put("k", b"same")
    assert a.get_with_etag("k")[1] == b.get_with_etag("k")[1]


def test_relative_root_and_file_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    bucket = LocalBucket("rel/dir")
    assert bucket.root == tmp_path / "rel" / "dir"
    assert bucket.url.startswith("file:///")
    assert "LocalBucket('file://" in repr(bucket)
