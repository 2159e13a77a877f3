"""``stoa retriever index|upload|search`` through the CLI entry point: exit codes and what they write."""

from __future__ import annotations

from stoa.cli import main
from stoa.retrieval import BM25Index, read_corpus

from .conftest import write_jsonl


def corpus(tmp_path):
    return write_jsonl(tmp_path / "c.jsonl", [
        {"id": "a", "title": "Ada", "text": "Ada Lovelace wrote the first program."},
        {"id": "b", "contents": '"Grace Hopper"\nGrace Hopper built a compiler.'},
    ])


def test_index_then_search_and_upload(tmp_path, capsys):
    path = corpus(tmp_path)
    assert main(["retriever", "index", str(path), str(tmp_path / "ix")]) == 0
    index = BM25Index.load(tmp_path / "ix")
    assert index.fingerprint == BM25Index.build(read_corpus(path)).fingerprint
    assert index.fingerprint in capsys.readouterr().out
    assert main(["retriever", "search", "compiler", "--index", str(tmp_path / "ix"), "-k", "1"]) == 0
    assert capsys.readouterr().out == "Doc 1(Title: Grace Hopper) Grace Hopper built a compiler.\n"
    assert main(["retriever", "upload", str(tmp_path / "ix"), "--bucket", str(tmp_path / "b"), "--run", "r"]) == 0
    assert (tmp_path / "b" / "runs" / "r" / "retriever" / index.fingerprint / "stoa-index.json").is_file()


def test_bad_input_exits_2(tmp_path, capsys):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"id": "a", "text": "x"}, {"id": "b"}])
    assert main(["retriever", "index", str(bad), str(tmp_path / "o")]) == 2
    assert f"{bad}:2:" in capsys.readouterr().err
    assert main(["retriever", "index", str(tmp_path / "missing.jsonl"), str(tmp_path / "o")]) == 2
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    assert main(["retriever", "index", str(corpus(tmp_path)), str(tmp_path / "full")]) == 2
    assert main(["retriever", "serve", "--index", str(tmp_path / "full")]) == 2
    assert main(["retriever", "search", "q", "--index", str(tmp_path / "full")]) == 2
