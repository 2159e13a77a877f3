"""BM25Index: save/load (mmap) gives the same answers, batches equal single queries, ties are deterministic,
the fingerprint names the corpus and settings, and a damaged or incomplete directory is refused."""

from __future__ import annotations

import json
import shutil

import pytest

from stoa.retrieval import BadIndex, BM25Index, CorpusError, Doc, IndexSettings, corpus_fingerprint, verify_index_dir
from stoa.retrieval.bm25 import DOCS_FILE, ENGLISH_STOPWORDS, INDEX_MANIFEST

from .conftest import make_docs

QUERIES = ["code zq7x", "river mountain", "city harbour entity 3", "glimmerstone", "the of a", "",
           "nothing matches this", "zq12x zq30x", "entity"]


def ids(results: list[list[Doc]]) -> list[list[str]]:
    return [[d.id for d in docs] for docs in results]


def test_finds_the_document_with_the_rare_word(index):
    assert ids(index.search(["code zq7x"], 3))[0][0] == "d7"
    assert ids(index.search(["zq12x zq30x"], 2)) == [["d12", "d30"]]  # equal scores: corpus order


def test_saved_and_mmapped_index_answers_the_same(index, index_dir):
    for use_mmap in (True, False):
        loaded = BM25Index.load(index_dir, mmap=use_mmap)
        assert loaded.fingerprint == index.fingerprint
        for k in (1, 3, 50):
            assert loaded.search(QUERIES, k) == index.search(QUERIES, k)
    assert verify_index_dir(index_dir) == index.fingerprint


def test_batch_equals_single_queries(index):
    batch = index.search(QUERIES, 4)
    assert batch == [index.search([q], 4)[0] for q in QUERIES]
    assert index.search([], 3) == []


def test_ties_break_by_corpus_position_also_across_k(index):
    assert ids(index.search(["glimmerstone"], 2)) == [["twin-a", "twin-b"]]
    assert ids(index.search(["glimmerstone"], 3)) == [["twin-a", "twin-b", "twin-c"]]
    # 20 documents tie on "river mountain": the first k by position, however bm25s partitions them
    odd = [f"d{i}" for i in range(1, 40, 2)]
    for k in (1, 5, 19, 20):
        assert ids(index.search(["river mountain"], k)) == [odd[:k]]


def test_documents_without_a_query_word_are_not_returned(index):
    assert ids(index.search(["nothing matches this", "the of a", ""], 3)) == [[], [], []]
    assert len(index.search(["glimmerstone"], 10)[0]) == 3


def test_k_must_be_positive(index):
    with pytest.raises(ValueError, match="k: must be >= 1"):
        index.search(["x"], 0)


def test_fingerprint_names_content_and_settings(docs, index):
    assert corpus_fingerprint(docs) == index.fingerprint == BM25Index.build(make_docs()).fingerprint
    changed = [*docs[:-1], Doc("twin-c", "Twin", "glimmerstone is a rare mineral!")]
    assert corpus_fingerprint(changed) != index.fingerprint
    assert corpus_fingerprint(docs[::-1]) != index.fingerprint
    assert corpus_fingerprint(docs, IndexSettings(k1=1.2)) != index.fingerprint
    assert len(index.fingerprint) == 32


def test_stopwords_are_bm25s_english_ones():
    import bm25s.stopwords

    assert tuple(ENGLISH_STOPWORDS) == tuple(bm25s.stopwords.STOPWORDS_EN)


def test_repeated_id_refused():
    with pytest.raises(CorpusError, match="repeats"):
        BM25Index.build([Doc("a", "", "x y"), Doc("a", "", "z w")])


def test_incomplete_index_refused(index_dir, tmp_path):
    copy = shutil.copytree(index_dir, tmp_path / "ix")
    (copy / INDEX_MANIFEST).unlink()
    with pytest.raises(BadIndex, match="not a complete index"):
        BM25Index.load(copy)
    copy = shutil.copytree(index_dir, tmp_path / "ix2")
    (copy / DOCS_FILE).unlink()
    with pytest.raises(BadIndex, match="missing"):
        BM25Index.load(copy)


def test_altered_documents_refused_by_verify(index_dir, tmp_path):
    copy = shutil.copytree(index_dir, tmp_path / "ix")
    text = (copy / DOCS_FILE).read_text().replace("rare mineral", "fake mineral")
    (copy / DOCS_FILE).write_text(text)
    with pytest.raises(BadIndex, match="digest"):
        verify_index_dir(copy)
    with pytest.raises(BadIndex):
        BM25Index.load(copy, verify=True)
    # a manifest rewritten to the altered file's digest still fails the fingerprint
    manifest = json.loads((copy / INDEX_MANIFEST).read_text())
    from stoa.bucket.base import file_digest

    manifest["files"][DOCS_FILE] = {"size": (copy / DOCS_FILE).stat().st_size, "digest": file_digest(copy / DOCS_FILE)}
    (copy / INDEX_MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BadIndex, match="fingerprint"):
        verify_index_dir(copy)


def test_many_equal_documents_give_the_first_ones():
    # bm25s's argpartition picks arbitrary members of a large tie; the answer must not depend on it
    index = BM25Index.build([Doc(f"t{i}", "", "tiedword filler") for i in range(300)] + [Doc("x", "", "other")])
    for k in (1, 3, 7, 50):
        assert ids(index.search(["tiedword"], k)) == [[f"t{i}" for i in range(k)]]
