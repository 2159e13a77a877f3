"""Small corpora and indexes for the retrieval tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stoa.retrieval import BM25Index, Doc


def make_docs(n: int = 40) -> list[Doc]:
    """``n`` documents with distinct rare words, repeated common words and exact duplicates (ties)."""
    docs = []
    for i in range(n):
        common = "river mountain" if i % 2 else "city harbour"
        docs.append(Doc(f"d{i}", f"Entity {i}", f"The entity {i} lives near the {common}. Its code is zq{i}x."))
    docs.append(Doc("twin-a", "Twin", "glimmerstone is a rare mineral"))
    docs.append(Doc("twin-b", "Twin", "glimmerstone is a rare mineral"))
    docs.append(Doc("twin-c", "Twin", "glimmerstone is a rare mineral"))
    return docs


def write_jsonl(path: Path, rows: list) -> Path:
    """Write one JSON value per line (strings are written as they are)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    return make_docs()


@pytest.fixture(scope="module")
def index(docs) -> BM25Index:
    return BM25Index.build(docs)


@pytest.fixture(scope="module")
def index_dir(index, tmp_path_factory) -> Path:
    return index.save(tmp_path_factory.mktemp("index") / "ix")
