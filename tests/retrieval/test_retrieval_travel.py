"""The index through a local bucket: create-only upload with the manifest last, a verified download, and a
partial or tampered copy refused and never loaded; open_searcher's three ways."""

from __future__ import annotations

from typing import cast

import pytest

from stoa.bucket import Bucket, ObjectNotFound, open_bucket
from stoa.layout import retriever_file_key, retriever_prefix
from stoa.retrieval import (
    BadIndex,
    BM25Index,
    HTTPSearcher,
    RetrieverMismatch,
    download_index,
    open_searcher,
    upload_index,
)
from stoa.retrieval.bm25 import DOCS_FILE, INDEX_MANIFEST

RUN = "r1"


class RecordingBucket:
    """A local bucket that records the order of writes."""

    def __init__(self, inner):
        self.inner = inner
        self.url = inner.url
        self.writes: list[str] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_create(self, key, data):
        self.writes.append(key)
        self.inner.put_create(key, data)

    def put_file(self, key, path, *, create_only=True):
        assert create_only
        self.writes.append(key)
        self.inner.put_file(key, path, create_only=create_only)


def test_upload_writes_every_file_create_only_manifest_last(index, index_dir, tmp_path):
    bucket = cast(Bucket, RecordingBucket(open_bucket(str(tmp_path / "b"))))
    fp = upload_index(bucket, RUN, index_dir)
    assert fp == index.fingerprint
    names = sorted(p.name for p in index_dir.iterdir())
    writes = cast(RecordingBucket, bucket).writes
    assert sorted(writes) == [retriever_file_key(RUN, fp, n) for n in names]
    assert writes[-1] == retriever_file_key(RUN, fp, INDEX_MANIFEST)
    writes.clear()
    assert upload_index(bucket, RUN, index_dir) == fp and writes == []  # already complete: kept


def test_download_verifies_and_loads_the_same_index(index, index_dir, tmp_path):
    bucket = open_bucket(str(tmp_path / "b"))
    fp = upload_index(bucket, RUN, index_dir)
    notes: list[str] = []
    dest = download_index(bucket, RUN, fp, tmp_path / "cache" / fp, note=notes.append)
    assert BM25Index.load(dest).search(["glimmerstone", "zq7x"], 3) == index.search(["glimmerstone", "zq7x"], 3)
    assert len(notes) == 1 and fp in notes[0]
    assert download_index(bucket, RUN, fp, dest, note=notes.append) == dest and len(notes) == 1  # reused
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [fp]  # no partial directory left


def test_tampered_object_is_refused_and_nothing_is_kept(index_dir, tmp_path):
    bucket = open_bucket(str(tmp_path / "b"))
    fp = upload_index(bucket, RUN, index_dir)
    key = retriever_file_key(RUN, fp, DOCS_FILE)
    bucket.put(key, bucket.get(key).replace(b"rare mineral", b"fake mineral"))
    dest = tmp_path / "cache" / fp
    with pytest.raises(BadIndex, match="digest"):
        download_index(bucket, RUN, fp, dest, note=lambda m: None)
    assert not dest.exists() and list((tmp_path / "cache").iterdir()) == []
    with pytest.raises(BadIndex):
        open_searcher(bucket=bucket, run_id=RUN, fingerprint=fp, cache_dir=tmp_path / "cache", note=lambda m: None)


def test_partial_upload_is_not_an_index(index_dir, tmp_path):
    bucket = open_bucket(str(tmp_path / "b"))
    fp = upload_index(bucket, RUN, index_dir)
    bucket.delete(retriever_file_key(RUN, fp, INDEX_MANIFEST))
    with pytest.raises(ObjectNotFound, match=retriever_prefix(RUN, fp)):
        download_index(bucket, RUN, fp, tmp_path / "d", note=lambda m: None)
    assert not (tmp_path / "d").exists()
    upload_index(bucket, RUN, index_dir)
    bucket.delete(retriever_file_key(RUN, fp, DOCS_FILE))
    with pytest.raises(ObjectNotFound):
        download_index(bucket, RUN, fp, tmp_path / "d", note=lambda m: None)
    assert not (tmp_path / "d").exists()


def test_manifest_of_another_index_is_refused(index_dir, tmp_path):
    bucket = open_bucket(str(tmp_path / "b"))
    fp = upload_index(bucket, RUN, index_dir)
    other = "1" * 32
    bucket.put_create(retriever_file_key(RUN, other, INDEX_MANIFEST), bucket.get(retriever_file_key(RUN, fp,
                                                                                                  INDEX_MANIFEST)))
    with pytest.raises(BadIndex, match="names index"):
        download_index(bucket, RUN, other, tmp_path / "d", note=lambda m: None)


def test_destination_holding_something_else_is_not_overwritten(index_dir, tmp_path):
    bucket = open_bucket(str(tmp_path / "b"))
    fp = upload_index(bucket, RUN, index_dir)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "mine.txt").write_text("keep")
    with pytest.raises(BadIndex, match="remove it"):
        download_index(bucket, RUN, fp, tmp_path / "d", note=lambda m: None)
    assert (tmp_path / "d" / "mine.txt").read_text() == "keep"
    with pytest.raises(ValueError, match="32 lowercase hex"):
        download_index(bucket, RUN, "../x", tmp_path / "e")


def test_open_searcher_ways(index, index_dir, tmp_path):
    assert isinstance(open_searcher(url="http://127.0.0.1:9", fingerprint=index.fingerprint), HTTPSearcher)
    local = open_searcher(index_dir=index_dir, fingerprint=index.fingerprint)
    assert local.fingerprint == index.fingerprint
    with pytest.raises(RetrieverMismatch):
        open_searcher(index_dir=index_dir, fingerprint="2" * 32)
    bucket = open_bucket(str(tmp_path / "b"))
    upload_index(bucket, RUN, index_dir)
    fetched = open_searcher(bucket=bucket, run_id=RUN, fingerprint=index.fingerprint, cache_dir=tmp_path / "c",
                            note=lambda m: None)
    assert fetched.search(["zq5x"], 1) == index.search(["zq5x"], 1)
    with pytest.raises(ValueError, match="give an endpoint URL"):
        open_searcher(bucket=bucket, run_id=RUN)
