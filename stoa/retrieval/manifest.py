"""The manifest of a BM25 index directory (``stoa-index.json``) and the settings it carries, read as untrusted.

An index may come from a run's bucket, where any writer can forge its files: the manifest is parsed by its schema
(:class:`stoa.schemas.index.IndexManifest`: bounds, every field checked) and its settings here; anything else is
``BadIndex`` (one line, exit 2), never another exception. ``stoa.retrieval.bm25`` re-exports these names.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stoa.schemas import BadSchemaObject
from stoa.schemas.index import INDEX_FORMAT, INDEX_MANIFEST, MAX_MANIFEST_BYTES, IndexManifest
from stoa.untrusted import field_float, field_str, loads_bounded

__all__ = ["DOCS_FILE", "ENGLISH_STOPWORDS", "INDEX_FORMAT", "INDEX_MANIFEST", "BadIndex", "IndexSettings",
           "MAX_MANIFEST_BYTES", "OFFSETS_FILE", "check_json_files", "read_manifest"]

DOCS_FILE = "docs.jsonl"
"""The documents, one ``[id, title, text]`` JSON array per line, in index order."""
OFFSETS_FILE = "docs.offsets.npy"
"""int64 byte offsets of every line of ``DOCS_FILE`` and its end (documents + 1 entries)."""
MAX_STOPWORDS = 4096
"""Most stopwords the settings may hold."""
MAX_DOC_BYTES = 64 << 20
"""Largest document line read."""
MAX_JSON_FILE_BYTES = 4 << 30
"""Largest bm25s JSON file (the vocabulary) accepted."""

ENGLISH_STOPWORDS = ("a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "if", "in", "into", "is", "it",
                     "no", "not", "of", "on", "or", "such", "that", "the", "their", "then", "there", "these",
                     "they", "this", "to", "was", "will", "with")
"""bm25s's English stopwords (``bm25s.stopwords.STOPWORDS_EN``), frozen here so settings never drift."""


class BadIndex(ValueError):
    """An index directory that is incomplete, damaged or of another corpus; the message names the file."""


@dataclass(frozen=True)
class IndexSettings:
    """What the index computes besides the corpus (part of the fingerprint)."""

    k1: float = 1.5
    """BM25 term-frequency saturation."""
    b: float = 0.75
    """BM25 length normalisation."""
    method: str = "lucene"
    """bm25s scoring variant."""
    token_pattern: str = r"(?u)\b\w\w+\b"
    """Regex of a token (on lowercased text): words of two or more characters, as bm25s and scikit-learn."""
    stopwords: tuple[str, ...] = field(default=ENGLISH_STOPWORDS)
    """Tokens dropped from documents and queries."""

    def to_json(self) -> dict[str, Any]:
        """The settings as a JSON object."""
        d = asdict(self)
        d["stopwords"] = list(self.stopwords)
        return d

    @classmethod
    def from_json(cls, d: Any) -> IndexSettings:
        """Settings from ``to_json``'s form, every field checked (the manifest may come from a bucket).

        Args:
            d: the decoded object.

        Raises:
            BadIndex: a missing field or one of the wrong type or size.
        """
        try:
            if not isinstance(d, dict):
                raise ValueError(f"an object, not a {type(d).__name__}")
            words = d.get("stopwords")
            if not isinstance(words, list) or len(words) > MAX_STOPWORDS or not all(
                    isinstance(w, str) and len(w) <= 64 for w in words):
                raise ValueError(f"stopwords must be a list of at most {MAX_STOPWORDS} short strings")
            return cls(k1=field_float(d, "k1", bound=1e6), b=field_float(d, "b", bound=1e6),
                       method=field_str(d, "method", max_len=32), token_pattern=field_str(d, "token_pattern"),
                       stopwords=tuple(words))
        except ValueError as e:
            raise BadIndex(f"{INDEX_MANIFEST}: bad 'settings' ({e}); rebuild with stoa retriever index") from e


def read_manifest(root: str | Path) -> IndexManifest:
    """The manifest of an index directory (:class:`~stoa.schemas.index.IndexManifest`), its settings checked.

    Args:
        root: the index directory.

    Raises:
        BadIndex: missing (an incomplete index) or malformed (too large, too deep, wrong types).
    """
    path = Path(root) / INDEX_MANIFEST
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise BadIndex(f"{path} missing: not a complete index; build one with stoa retriever index") from None
    try:
        manifest = IndexManifest.parse(data, str(path))
    except BadSchemaObject as e:
        raise BadIndex(str(e)) from e
    IndexSettings.from_json(manifest.settings)
    return manifest


def check_json_files(root: Path, files: Iterable[str]) -> dict[str, Any]:
    """Parse each bm25s JSON file (vocabulary, parameters) with bounds before bm25s does: a forged one (too deep,
    a number too long) is refused here instead of crashing bm25s's parser.

    Args:
        root: the index directory.
        files: the manifest's files (names are what is read).

    Returns:
        File name -> its parsed content.

    Raises:
        BadIndex: a JSON file that is not bounded JSON (names it).
    """
    parsed = {}
    for name in files:
        if name.endswith(".json"):
            try:
                parsed[name] = loads_bounded((root / name).read_bytes(), max_bytes=MAX_JSON_FILE_BYTES, max_depth=2)
            except (ValueError, OSError) as e:
                raise BadIndex(f"{root / name}: not an index file ({str(e)[:200]}); the index is damaged") from e
    return parsed
