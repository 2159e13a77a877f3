"""read_corpus: accepted line forms, and every bad line refused naming the file and the line."""

from __future__ import annotations

import pytest

from stoa.retrieval import CorpusError, Doc, read_corpus
from stoa.retrieval.corpus import split_contents

from .conftest import write_jsonl


def test_reads_text_and_search_r1_contents(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [
        {"id": "a", "title": "Ada", "text": "Ada wrote notes."},
        "",
        {"id": 7, "contents": '"Grace Hopper"\nGrace wrote a compiler.\nSecond line.'},
        {"id": "c", "text": "No title here."},
        {"id": "d", "title": "Paper", "contents": "Abstract first line.\nMore."},
        {"id": "e", "title": "Paper", "contents": '"Paper"\nBody.'},
    ])
    assert list(read_corpus(path)) == [
        Doc("a", "Ada", "Ada wrote notes."),
        Doc("7", "Grace Hopper", "Grace wrote a compiler.\nSecond line."),
        Doc("c", "", "No title here."),
        Doc("d", "Paper", "Abstract first line.\nMore."),
        Doc("e", "Paper", "Body."),
    ]


def test_split_contents_keeps_unquoted_titles():
    assert split_contents("Plain title\nbody") == ("Plain title", "body")
    assert split_contents('"Quoted"\nbody') == ("Quoted", "body")


@pytest.mark.parametrize(("bad", "words"), [
    ("{not json", "not a JSON line"),
    ('["a list"]', "JSON object"),
    ('{"title": "t", "text": "x"}', "'id'"),
    ('{"id": "", "text": "x"}', "'id'"),
    ('{"id": "b"}', "'text'"),
    ('{"id": "b", "text": "   "}', "'text'"),
    ('{"id": "b", "text": "x", "title": 3}', "'title'"),
    ('{"id": "a", "text": "again"}', "repeats line 1"),
])
def test_bad_line_names_file_and_line(tmp_path, bad, words):
    path = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "text": "first"}, "", bad])
    with pytest.raises(CorpusError) as e:
        list(read_corpus(path))
    assert str(e.value).startswith(f"{path}:3:")
    assert words in str(e.value)


def test_empty_corpus_cannot_be_indexed(tmp_path):
    from stoa.retrieval import BM25Index

    with pytest.raises(CorpusError, match="no documents"):
        BM25Index.build(read_corpus(write_jsonl(tmp_path / "c.jsonl", [""])))
