"""A run's index in the bucket is untrusted: a forged manifest (deep, huge, wrong types, invalid UTF-8, long
numbers, NaN), forged documents or a forged bm25s file is a ``BadIndex`` (one line, exit 2) and nothing is kept;
a worker cannot run the search task without it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from stoa.bucket import open_bucket
from stoa.bucket.base import file_digest
from stoa.cli import user_error
from stoa.layout import retriever_file_key
from stoa.retrieval import BadIndex, IndexSettings, open_searcher, upload_index, verify_index_dir
from stoa.retrieval.bm25 import DOCS_FILE, INDEX_MANIFEST, OFFSETS_FILE, read_manifest
from stoa.retrieval.manifest import MAX_MANIFEST_BYTES

RUN = "r1"


def _manifest(index_dir: Path) -> dict:
    return json.loads((index_dir / INDEX_MANIFEST).read_bytes())


def _variants(good: dict) -> dict[str, bytes]:
    """Forged manifests for the index ``good`` describes (same fingerprint, so the key is the run's)."""
    def with_(**kw) -> bytes:
        return json.dumps({**good, **kw}).encode()

    def settings(**kw) -> bytes:
        return with_(settings={**good["settings"], **kw})

    raw = json.dumps(good).encode()
    return {
        "deep": b"[" * 100_000,
        "deep inside": with_(settings={"stopwords": [[[["x"]]]]}),
        "deep object": b'{"a": ' * 100_000,
        "huge": with_(pad="x" * MAX_MANIFEST_BYTES),
        "a list": b"[1, 2, 3]",
        "invalid UTF-8": raw[:-1] + b', "x": "\xff\xfe"}',
        "long integer": raw.replace(b'"docs": %d' % good["docs"], b'"docs": ' + b"9" * 5001),
        "NaN": settings(k1=float("nan")),
        "Infinity": raw.replace(b'"k1": 1.5', b'"k1": Infinity'),
        "settings a list": with_(settings=[1, 2]),
        "files a list": with_(files=[INDEX_MANIFEST]),
        "file entry a list": with_(files={**good["files"], DOCS_FILE: [1, 2]}),
        "size a string": with_(files={**good["files"], DOCS_FILE: {"size": "12", "digest": "x"}}),
        "docs a bool": with_(docs=True),
        "k1 a string": settings(k1="1.5"),
        "stopwords a string": settings(stopwords="the"),
        "traversal": with_(files={**good["files"], "../evil": {"size": 1, "digest": "x"}}),
    }


@pytest.fixture
def published(index_dir, tmp_path):
    bucket = open_bucket(str(tmp_path / "b"))
    fp = upload_index(bucket, RUN, index_dir)
    return bucket, fp


def test_every_forged_manifest_is_a_bad_index_with_one_line_and_nothing_is_kept(published, index_dir, tmp_path,
                                                                                 monkeypatch):
    bucket, fp = published
    whole = bucket.get
    monkeypatch.setattr(bucket, "get", lambda key: whole(key) if not key.endswith(INDEX_MANIFEST) else pytest.fail(
        "the manifest is read whole"))
    variants = _variants(_manifest(index_dir))
    assert b"Infinity" in variants["Infinity"] and b"9" * 5001 in variants["long integer"]
    for kind, data in variants.items():
        bucket.put(retriever_file_key(RUN, fp, INDEX_MANIFEST), data)
        dest = tmp_path / "cache" / kind / fp
        with pytest.raises(BadIndex) as e:
            open_searcher(bucket=bucket, run_id=RUN, fingerprint=fp, cache_dir=dest.parent, note=lambda _: None)
        row = user_error(e.value)
        assert row is not None and row.code == 2, kind
        assert "\n" not in row.line(e.value), kind
        assert not dest.exists() and list(dest.parent.iterdir()) == [], kind  # no partial copy left


def test_a_forged_manifest_on_disk_is_refused_by_every_reader(index_dir, tmp_path):
    for kind, data in _variants(_manifest(index_dir)).items():
        root = tmp_path / kind.replace(" ", "-")
        shutil.copytree(index_dir, root)
        (root / INDEX_MANIFEST).write_bytes(data)
        for read in (read_manifest, verify_index_dir):
            with pytest.raises(BadIndex):
                read(root)
    with pytest.raises(BadIndex, match="settings"):
        IndexSettings.from_json({"k1": 1.5, "b": 0.75, "method": "lucene", "token_pattern": "x", "stopwords": {}})


def _forge(index_dir: Path, root: Path, name: str, data: bytes) -> Path:
    """A copy of the index with ``name`` replaced and the manifest made to agree (as a bucket writer could)."""
    shutil.copytree(index_dir, root)
    (root / name).write_bytes(data)
    manifest = _manifest(root)
    manifest["files"][name] = {"size": len(data), "digest": file_digest(root / name)}
    (root / INDEX_MANIFEST).write_text(json.dumps(manifest))
    return root


@pytest.mark.parametrize("line", [b"[" * 100_000, b'["d0", "t", ' + b"1" * 5001 + b"]", b'{"id": "d0"}',
                                  b'["d0", "t"]', b'["d0", "t", NaN]', b'["d0", "\xff", "x"]', b"[1, 2, 3]"])
def test_forged_documents_are_refused_before_the_fingerprint_is_trusted(index_dir, tmp_path, line):
    import numpy as np

    root = tmp_path / "forged"
    data = (index_dir / DOCS_FILE).read_bytes()
    first = data.index(b"\n") + 1
    forged = line + b"\n" + data[first:]
    _forge(index_dir, root, DOCS_FILE, forged)
    offsets = np.load(index_dir / OFFSETS_FILE)
    offsets[1:] += len(line) + 1 - first
    np.save(root / OFFSETS_FILE, offsets)
    manifest = _manifest(root)
    manifest["files"][OFFSETS_FILE] = {"size": (root / OFFSETS_FILE).stat().st_size,
                                       "digest": file_digest(root / OFFSETS_FILE)}
    (root / INDEX_MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BadIndex, match="document 0"):
        verify_index_dir(root)


@pytest.mark.parametrize("data", [b"[" * 100_000, b'{"k1": ' + b"1" * 5001 + b"}", b"\xff\xfe", b"{\"bogus\": 1}"])
def test_a_forged_bm25s_file_is_refused_and_not_handed_to_bm25s(index_dir, tmp_path, data):
    from stoa.retrieval import BM25Index

    root = _forge(index_dir, tmp_path / "forged", "params.index.json", data)
    with pytest.raises(BadIndex):
        BM25Index.load(root, verify=True)
    if data == b"{\"bogus\": 1}":  # well-formed JSON, but not bm25s's parameters: bm25s's own error becomes BadIndex
        with pytest.raises(BadIndex, match="bm25s cannot load it"):
            BM25Index.load(root, verify=False)
    else:
        with pytest.raises(BadIndex, match="params.index.json"):
            verify_index_dir(root)


def test_offsets_that_are_not_a_list_are_refused(index_dir, tmp_path):
    import io

    import numpy as np

    buf = io.BytesIO()
    np.save(buf, np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(BadIndex, match="offsets"):
        verify_index_dir(_forge(index_dir, tmp_path / "2d", OFFSETS_FILE, buf.getvalue()))
    with pytest.raises(BadIndex, match="not readable"):
        verify_index_dir(_forge(index_dir, tmp_path / "junk", OFFSETS_FILE, b"junk"))
    from stoa.retrieval import BM25Index

    empty = _forge(index_dir, tmp_path / "empty", DOCS_FILE, b"")  # the offsets still name 43 documents
    with pytest.raises(BadIndex, match="document 0"):  # an empty file is never memory-mapped: one line, not a crash
        BM25Index.load(empty, mmap=True).search(["entity"], 1)
    (empty / DOCS_FILE).unlink()
    manifest = _manifest(empty)
    del manifest["files"][DOCS_FILE]  # a manifest that does not list the documents at all
    (empty / INDEX_MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BadIndex, match="not readable"):
        BM25Index.load(empty, mmap=True)


@pytest.mark.parametrize("fingerprint", ["../x", "/etc/passwd", "file:///x", "~/x", "AB" * 16, "a" * 31, ["a" * 32],
                                         "", None, 0])
def test_a_contract_names_the_index_only_by_its_fingerprint(published, tmp_path, monkeypatch, fingerprint):
    from stoa.episodes.task_tools import open_task_tools
    from stoa.tasks import get_task

    bucket, _ = published
    monkeypatch.setenv("STOA_CACHE", str(tmp_path / "cache"))
    with pytest.raises(BadIndex) as e:
        open_task_tools(get_task("search"), "", role="worker", bucket=bucket, run_id=RUN,
                        spec={"fingerprint": fingerprint}, note=lambda _: None)
    row = user_error(e.value)
    assert row is not None and row.code == 2 and "\n" not in row.line(e.value)
    assert not (tmp_path / "cache").exists()  # nothing fetched, nothing written


def _npy(a) -> bytes:
    import io

    import numpy as np

    buf = io.BytesIO()
    np.save(buf, np.asarray(a))
    return buf.getvalue()


def _array_forgeries(index_dir: Path) -> dict[str, tuple[str, bytes]]:
    """bm25s files a bucket writer could swap in (with a manifest that agrees): the fingerprint does not see them."""
    import numpy as np

    ind, ptr, data = (np.load(index_dir / f"{n}.csc.index.npy") for n in ("indices", "indptr", "data"))
    params = json.loads((index_dir / "params.index.json").read_bytes())
    vocab = json.loads((index_dir / "vocab.index.json").read_bytes())
    n_docs = params["num_docs"]
    return {
        "num_docs huge": ("params.index.json", json.dumps({**params, "num_docs": 10**12}).encode()),
        "num_docs a string": ("params.index.json", json.dumps({**params, "num_docs": "43"}).encode()),
        "another backend": ("params.index.json", json.dumps({**params, "backend": "numba"}).encode()),
        "another int dtype": ("params.index.json", json.dumps({**params, "int_dtype": "float64"}).encode()),
        "another method": ("params.index.json", json.dumps({**params, "method": "bm25l"}).encode()),
        "a delta string": ("params.index.json", json.dumps({**params, "delta": "x"}).encode()),
        "an unknown parameter": ("params.index.json", json.dumps({**params, "corpus": "/etc/passwd"}).encode()),
        "k1 not the settings'": ("params.index.json", json.dumps({**params, "k1": 9.0}).encode()),
        "document id out of range": ("indices.csc.index.npy", _npy(np.where(ind == 0, n_docs, ind).astype(ind.dtype))),
        "negative document id": ("indices.csc.index.npy", _npy(np.where(ind == 0, -1, ind).astype(ind.dtype))),
        "column past the end": ("indptr.csc.index.npy", _npy(np.append(ptr[:-1], ptr[-1] + 5))),
        "columns backwards": ("indptr.csc.index.npy", _npy(ptr[::-1].copy())),
        "NaN scores": ("data.csc.index.npy", _npy(np.where(np.arange(len(data)) == 0, np.nan, data).astype(
            data.dtype))),
        "2-D ids": ("indices.csc.index.npy", _npy(ind.reshape(2, -1))),
        "token past the columns": ("vocab.index.json", json.dumps({**vocab, "entity": len(ptr) - 1}).encode()),
        "token id a float": ("vocab.index.json", json.dumps({**vocab, "entity": 0.5}).encode()),
    }


def test_forged_bm25s_arrays_that_disagree_with_the_documents_are_refused(index_dir, tmp_path):
    from stoa.retrieval import BM25Index

    assert verify_index_dir(index_dir)  # the honest index passes the same checks
    for kind, (name, data) in _array_forgeries(index_dir).items():
        root = _forge(index_dir, tmp_path / kind.replace(" ", "-"), name, data)
        with pytest.raises(BadIndex, match="disagree|not readable"):
            BM25Index.load(root, verify=True)
