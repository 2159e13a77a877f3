"""Reading a corpus: one JSON document per line (``id`` and ``text``, or Search-R1's ``contents``).

Accepted line forms (``title`` optional in both)::

    {"id": "d1", "title": "Ada Lovelace", "text": "Ada Lovelace was ..."}
    {"id": "d1", "contents": "\\"Ada Lovelace\\"\\nAda Lovelace was ..."}     # Search-R1: first line = quoted title

With both ``title`` and ``contents``, the first line of ``contents`` is dropped only when it is the title.

A line that is not a bounded JSON object (``stoa.untrusted``: size, depth, numbers), lacks an id or a text, or
repeats an id raises ``CorpusError`` naming the file and the line.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from stoa.retrieval.base import Doc
from stoa.untrusted import loads_bounded

__all__ = ["CorpusError", "check_unique", "doc_from_json", "read_corpus", "split_contents"]


MAX_LINE_BYTES = 16 << 20
"""Longest corpus line read (a corpus may come from a run's bucket: every line is parsed with bounds)."""
MAX_LINE_DEPTH = 16
"""Deepest JSON nesting of a line (a document is a flat object)."""


class CorpusError(ValueError):
    """A corpus line that cannot be a document; the message names the file, the line and the fix."""


def split_contents(contents: str) -> tuple[str, str]:
    """Search-R1's ``contents`` as ``(title, text)``: the first line is the title (surrounding quotes removed).

    Args:
        contents: e.g. ``'"Ada Lovelace"\\nAda Lovelace was ...'``.
    """
    head, _, body = contents.partition("\n")
    head = head.strip()
    if len(head) >= 2 and head[0] == head[-1] == '"':
        head = head[1:-1]
    return head, body


def doc_from_json(obj: object) -> Doc:
    """The document a decoded corpus line describes.

    Args:
        obj: the decoded JSON value of one line.

    Raises:
        ValueError: not an object, no usable id, or no text (the message names the field).
    """
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    doc_id = obj.get("id", obj.get("_id"))
    if isinstance(doc_id, int) and not isinstance(doc_id, bool):
        doc_id = str(doc_id)
    if not isinstance(doc_id, str) or not doc_id.strip():
        raise ValueError("'id' missing or empty: give every document a unique string or integer id")
    title = obj.get("title")
    if title is not None and not isinstance(title, str):
        raise ValueError("'title' must be a string")
    text = obj.get("text")
    if text is None and isinstance(obj.get("contents"), str):
        parsed_title, body = split_contents(obj["contents"])
        if title is None or parsed_title == title:
            title, text = parsed_title, body
        else:  # a separate title and contents that do not start with it: the contents are all text
            text = obj["contents"]
    if not isinstance(text, str) or not text.strip():
        raise ValueError("'text' (or Search-R1's 'contents') missing or empty: every document needs a body")
    return Doc(id=doc_id, title=title or "", text=text)


def read_corpus(path: str | Path) -> Iterator[Doc]:
    """The documents of a jsonl corpus, in file order (blank lines are skipped).

    Args:
        path: the corpus file.

    Raises:
        CorpusError: a bad line (names the file and the 1-based line number) or a repeated id.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    seen: dict[str, int] = {}
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = loads_bounded(raw, max_bytes=MAX_LINE_BYTES, max_depth=MAX_LINE_DEPTH)
            except ValueError as e:  # also invalid UTF-8, too deep, a number too long, NaN
                raise CorpusError(f"{path}:{number}: not a JSON line ({str(e)[:200]}); write one JSON object "
                                  "per line") from e
            try:
                doc = doc_from_json(obj)
            except ValueError as e:
                raise CorpusError(f"{path}:{number}: {e}") from e
            if doc.id in seen:
                raise CorpusError(f"{path}:{number}: id {doc.id!r} repeats line {seen[doc.id]}; ids must be unique")
            seen[doc.id] = number
            yield doc


def check_unique(docs: Iterable[Doc]) -> Iterator[Doc]:
    """Pass documents through, refusing a repeated id (for corpora that come from code, not a file).

    Args:
        docs: documents.

    Raises:
        CorpusError: a repeated id (names its position).
    """
    seen: set[str] = set()
    for i, doc in enumerate(docs):
        if doc.id in seen:
            raise CorpusError(f"document {i}: id {doc.id!r} repeats; ids must be unique")
        if not doc.text.strip():
            raise CorpusError(f"document {i} ({doc.id!r}): empty text; every document needs a body")
        seen.add(doc.id)
        yield doc
