"""A BM25 index on bm25s: built once, saved to a directory, loaded memory-mapped, searched in batches.

An index directory holds bm25s's arrays (``*.index.npy``, ``vocab.index.json``, ``params.index.json``), the
documents (``docs.jsonl``: one ``[id, title, text]`` JSON array per line, in index order, and
``docs.offsets.npy``: the byte offset of every line and the file's end) and, written last,
``stoa-index.json``: the fingerprint, the settings, and the size and xxh3-128 digest of every other file.

The fingerprint is the xxh3-128 of the settings and of every document's id, title and text, so equal corpora
and settings give equal fingerprints on any machine and bm25s version. Tokenisation is stoa's own (lowercase,
``token_pattern`` words, English stopwords stored in the settings; no stemmer, since PyStemmer is not a
dependency), so a query tokenises the same way wherever the index is loaded. Ties are broken by document
position (corpus order), never by bm25s's selection order; documents with score 0 (no query word) are never
returned. No torch, no mlx; bm25s is imported when an index is built or loaded.
"""

from __future__ import annotations

import json
import logging
import mmap
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from stoa.bucket.base import file_digest
from stoa.retrieval.base import Doc
from stoa.retrieval.corpus import CorpusError, check_unique
from stoa.retrieval.manifest import (
    DOCS_FILE,
    ENGLISH_STOPWORDS,
    INDEX_FORMAT,
    INDEX_MANIFEST,
    MAX_DOC_BYTES,
    OFFSETS_FILE,
    BadIndex,
    IndexSettings,
    check_json_files,
    read_manifest,
)
from stoa.schemas.index import IndexFile, IndexManifest
from stoa.untrusted import loads_bounded

_ARRAYS = ("data.csc.index.npy", "indices.csc.index.npy", "indptr.csc.index.npy")
"""bm25s's score matrix (scores, document ids, each token's column start)."""
PARAMS_FILE, VOCAB_FILE = "params.index.json", "vocab.index.json"
"""bm25s's parameters and vocabulary (token -> column)."""

__all__ = ["BM25Index", "DOCS_FILE", "ENGLISH_STOPWORDS", "INDEX_FORMAT", "INDEX_MANIFEST", "BadIndex",
           "IndexSettings", "OFFSETS_FILE", "corpus_fingerprint", "read_manifest", "verify_index_dir"]


class _Fingerprint:
    """Streaming xxh3-128 over the settings and every document's fields (length-prefixed)."""

    def __init__(self, settings: IndexSettings):
        self._h = xxhash.xxh3_128()
        self._feed("stoa-bm25s-index/1")
        self._feed(json.dumps(settings.to_json(), sort_keys=True, separators=(",", ":")))

    def _feed(self, s: str) -> None:
        b = s.encode("utf-8", "surrogatepass")
        self._h.update(len(b).to_bytes(8, "little"))
        self._h.update(b)

    def add(self, doc: Doc) -> None:
        for part in (doc.id, doc.title, doc.text):
            self._feed(part)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def corpus_fingerprint(docs: Iterable[Doc], settings: IndexSettings | None = None) -> str:
    """The fingerprint an index of ``docs`` built with ``settings`` has (without building it).

    Args:
        docs: the documents, in index order.
        settings: index settings (default ``IndexSettings()``).
    """
    fp = _Fingerprint(settings or IndexSettings())
    for doc in docs:
        fp.add(doc)
    return fp.hexdigest()


def _import_bm25s() -> Any:
    """bm25s, with its logger back to inheriting the process's level (bm25s forces DEBUG on import)."""
    import bm25s

    logger = logging.getLogger("bm25s")
    if logger.level == logging.DEBUG:
        logger.setLevel(logging.NOTSET)
    return bm25s


class _Tokenizer:
    """Lowercase, regex words, stopwords removed."""

    def __init__(self, settings: IndexSettings):
        self._pattern = re.compile(settings.token_pattern)
        self._stop = frozenset(settings.stopwords)

    def __call__(self, text: str) -> list[str]:
        return [t for t in self._pattern.findall(text.lower()) if t not in self._stop]


class _MappedDocs:
    """Documents of a saved index, read by offset from ``DOCS_FILE`` (memory-mapped or in memory).

    Raises:
        BadIndex: the offsets are not a 1-D integer array (on open), or a document line is not a bounded
            ``[id, title, text]`` array of strings (when read).
    """

    def __init__(self, root: Path, use_mmap: bool):
        try:
            self._offsets = np.load(root / OFFSETS_FILE, mmap_mode="r" if use_mmap else None)
            size = (root / DOCS_FILE).stat().st_size
        except (ValueError, OSError, EOFError) as e:
            raise BadIndex(f"{root}: {OFFSETS_FILE} or {DOCS_FILE} not readable ({str(e)[:200]}); the index is "
                           "damaged") from e
        if self._offsets.ndim != 1 or self._offsets.dtype.kind not in "iu" or len(self._offsets) < 1:
            raise BadIndex(f"{root / OFFSETS_FILE}: not a list of offsets; the index is damaged")
        self._where = root / DOCS_FILE
        if use_mmap and size > 0:  # an empty file cannot be mapped
            with open(root / DOCS_FILE, "rb") as f:
                self._buf: Any = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        else:
            self._buf = (root / DOCS_FILE).read_bytes()

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> Doc:
        a, b = int(self._offsets[i]), int(self._offsets[i + 1])
        try:
            row = loads_bounded(self._buf[max(a, 0):max(b, 0)], max_bytes=MAX_DOC_BYTES, max_depth=1)
        except ValueError as e:
            raise BadIndex(f"{self._where}: document {i} is not valid JSON ({str(e)[:200]}); the index is damaged") \
                from e
        if not isinstance(row, list) or len(row) != 3 or not all(isinstance(x, str) for x in row):
            raise BadIndex(f"{self._where}: document {i} is not [id, title, text]; the index is damaged")
        return Doc(*row)


def verify_index_dir(root: str | Path) -> str:
    """Check every file of an index directory against its manifest and recompute the fingerprint.

    Args:
        root: the index directory.

    Returns:
        The fingerprint.

    Raises:
        BadIndex: a missing, resized or altered file, or documents that do not give the fingerprint.
    """
    root = Path(root)
    manifest = read_manifest(root)
    for name, meta in sorted(manifest.files.items()):
        path = root / name
        if not path.is_file() or path.stat().st_size != meta.size:
            raise BadIndex(f"{path}: missing or not {meta.size} bytes as {INDEX_MANIFEST} says")
        if file_digest(path) != meta.digest:
            raise BadIndex(f"{path}: content differs from its digest in {INDEX_MANIFEST}; the index is damaged")
    parsed = check_json_files(root, manifest.files)
    docs = _MappedDocs(root, use_mmap=False)
    fp = _Fingerprint(IndexSettings.from_json(manifest.settings))
    if len(docs) != manifest.docs:
        raise BadIndex(f"{root / OFFSETS_FILE}: {len(docs)} documents, {INDEX_MANIFEST} says {manifest.docs}; "
                       "the index is damaged")
    _check_arrays(root, len(docs), IndexSettings.from_json(manifest.settings), parsed.get(PARAMS_FILE),
                  parsed.get(VOCAB_FILE))
    for i in range(len(docs)):
        fp.add(docs[i])
    if fp.hexdigest() != manifest.fingerprint:
        raise BadIndex(f"{root}: documents give fingerprint {fp.hexdigest()}, {INDEX_MANIFEST} says "
                          f"{manifest.fingerprint}; the index is damaged")
    return manifest.fingerprint


def _check_arrays(root: Path, n_docs: int, settings: IndexSettings, params: Any, vocab: Any) -> None:
    """bm25s's score matrix, parameters and vocabulary agree with the documents and settings (the fingerprint
    covers only those two): every document id in range, every token's column inside the arrays, finite scores,
    ``num_docs`` equal to the documents (bm25s allocates that many scores per query), and the parameters the ones
    stoa builds with (a forged backend or dtype would make bm25s import or index with something else)."""
    try:
        data, ind, ptr = (np.load(root / name, mmap_mode="r") for name in _ARRAYS)
    except (ValueError, OSError, EOFError) as e:
        raise BadIndex(f"{root}: bm25s's arrays not readable ({str(e)[:200]}); the index is damaged") from e
    shapes = (data.ndim == ind.ndim == ptr.ndim == 1 and len(data) == len(ind) and len(ptr) >= 1
              and ind.dtype.kind in "iu" and ptr.dtype.kind in "iu" and data.dtype.kind == "f")
    ok = (shapes and int(ptr[0]) == 0 and int(ptr[-1]) == len(ind) and bool((np.diff(ptr) >= 0).all())
          and (len(ind) == 0 or (int(ind.min()) >= 0 and int(ind.max()) < n_docs)) and bool(np.isfinite(data).all())
          and _params_ok(params, n_docs, settings) and isinstance(vocab, dict)
          and all(type(v) is int and (0 <= v < len(ptr) - 1 or (k == "" and v == len(ptr) - 1))
                  for k, v in vocab.items()))  # bm25s gives the empty token the id past the last column
    if not ok:
        raise BadIndex(f"{root}: bm25s's arrays, parameters or vocabulary disagree with the {n_docs} documents and "
                       "the settings; the index is damaged")


def _params_ok(params: Any, n_docs: int, settings: IndexSettings) -> bool:
    """Whether bm25s's parameters are those :meth:`BM25Index.build` writes for ``settings`` (absent optional ones
    take bm25s's defaults; ``delta`` and ``version`` are free but typed)."""
    if not isinstance(params, dict):
        return False
    need = {"k1": settings.k1, "b": settings.b, "method": settings.method, "num_docs": n_docs}
    optional = {"idf_method": settings.method, "backend": "numpy", "dtype": "float32", "int_dtype": "int32"}
    delta = params.get("delta", 0.5)
    return (set(params) <= {*need, *optional, "delta", "version"} and all(
        k in params and params[k] == v and type(params[k]) is type(v) for k, v in need.items())
        and all(params.get(k, v) == v for k, v in optional.items()) and isinstance(params.get("version", ""), str)
        and isinstance(delta, int | float) and not isinstance(delta, bool) and abs(delta) <= 1e6)


class BM25Index:
    """A bm25s index over a corpus (a ``Searcher``).

    Args:
        model: the bm25s ``BM25`` model.
        docs: the documents in index order (indexable: ``docs[i]``).
        settings: the settings it was built with.
        fingerprint: of the corpus and settings.
    """

    def __init__(self, model: Any, docs: Any, settings: IndexSettings, fingerprint: str):
        self._model = model
        self._docs = docs
        self.settings = settings
        self.fingerprint = fingerprint
        self._tokenize = _Tokenizer(settings)

    def __len__(self) -> int:
        return len(self._docs)

    @classmethod
    def build(cls, docs: Iterable[Doc], settings: IndexSettings | None = None,
              progress: Callable[[int], Any] | None = None) -> BM25Index:
        """Index documents (kept in memory, in the given order).

        Args:
            docs: the corpus (``read_corpus(path)`` or a task's ``corpus()``).
            settings: index settings (default ``IndexSettings()``).
            progress: called with the count of documents read, every 100,000 documents.

        Raises:
            CorpusError: no documents, an empty text or a repeated id.
        """
        bm25s = _import_bm25s()
        from bm25s.tokenization import Tokenized

        settings = settings or IndexSettings()
        tokenize, fp = _Tokenizer(settings), _Fingerprint(settings)
        vocab: dict[str, int] = {}
        ids: list[list[int]] = []
        kept: list[Doc] = []
        for doc in check_unique(docs):
            fp.add(doc)
            kept.append(doc)
            ids.append([vocab.setdefault(t, len(vocab)) for t in tokenize(f"{doc.title}\n{doc.text}")])
            if progress is not None and len(kept) % 100_000 == 0:
                progress(len(kept))
        if not kept:
            raise CorpusError("the corpus has no documents; give at least one line with an id and a text")
        model = bm25s.BM25(k1=settings.k1, b=settings.b, method=settings.method, backend="numpy")
        model.index(Tokenized(ids=ids, vocab=vocab), show_progress=False)
        return cls(model, kept, settings, fp.hexdigest())

    def save(self, root: str | Path) -> Path:
        """Write the index into ``root`` (created if missing), the manifest last.

        Args:
            root: the directory.
        """
        bm25s = _import_bm25s()
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        (root / INDEX_MANIFEST).unlink(missing_ok=True)
        self._model.save(str(root), corpus=None, show_progress=False)
        offsets = np.zeros(len(self._docs) + 1, dtype=np.int64)
        with open(root / DOCS_FILE, "wb") as f:
            for i in range(len(self._docs)):
                d = self._docs[i]
                f.write(json.dumps([d.id, d.title, d.text], ensure_ascii=False).encode("utf-8") + b"\n")
                offsets[i + 1] = f.tell()
        np.save(root / OFFSETS_FILE, offsets)
        files = {p.name: IndexFile(p.stat().st_size, file_digest(p))
                 for p in sorted(root.iterdir()) if p.is_file() and p.name != INDEX_MANIFEST}
        manifest = IndexManifest(self.fingerprint, len(self._docs), files, self.settings.to_json(),
                                 bm25s_version=getattr(bm25s, "__version__", ""))
        (root / INDEX_MANIFEST).write_bytes(manifest.to_json())
        return root

    @classmethod
    def load(cls, root: str | Path, mmap: bool = True, verify: bool = False) -> BM25Index:
        """Open a saved index.

        Args:
            root: the index directory.
            mmap: memory-map the arrays and documents (pages load on demand, shared between processes).
            verify: check every file's digest and the fingerprint first (reads the whole index once).

        Raises:
            BadIndex: no manifest (incomplete), a file missing, or (``verify``) damaged content.
        """
        bm25s = _import_bm25s()
        root = Path(root)
        if verify:
            verify_index_dir(root)
        manifest = read_manifest(root)
        missing = [n for n in manifest.files if not (root / n).is_file()]
        if missing:
            raise BadIndex(f"{root}: files {missing} missing; the index is incomplete, rebuild or download it")
        try:
            model = bm25s.BM25.load(str(root), mmap=mmap, load_corpus=False, show_progress=False)
        except (ValueError, TypeError, KeyError, OSError, RecursionError) as e:  # a damaged or forged file
            raise BadIndex(f"{root}: bm25s cannot load it ({type(e).__name__}: {str(e)[:200]}); the index is "
                           "damaged, rebuild or download it") from e
        docs = _MappedDocs(root, use_mmap=mmap)
        if len(docs) != manifest.docs:
            raise BadIndex(f"{root / OFFSETS_FILE}: {len(docs)} documents, {INDEX_MANIFEST} says "
                              f"{manifest.docs}; the index is damaged")
        return cls(model, docs, IndexSettings.from_json(manifest.settings), manifest.fingerprint)

    def tokens(self, text: str) -> list[str]:
        """The tokens the index sees in ``text``.

        Args:
            text: a query or document text.
        """
        return self._tokenize(text)

    def search(self, queries: Sequence[str], k: int) -> list[list[Doc]]:
        """The ``k`` best documents of each query (one bm25s retrieve for the batch), best first.

        Equal scores are ordered by document position; documents that match no query word are left out, so
        a query may get fewer than ``k`` (or no) documents.

        Args:
            queries: query texts.
            k: documents per query, >= 1.
        """
        if k < 1:
            raise ValueError(f"k: must be >= 1, got {k}")
        if not queries:
            return []
        tokens = [self._tokenize(q) for q in queries]
        wanted = min(k + 1, len(self._docs))
        found = self._model.retrieve(tokens, k=wanted, show_progress=False, backend_selection="numpy",
                                     n_threads=0, return_as="tuple")
        return [[self._docs[i] for i in self._select(np.asarray(s), np.asarray(ix), t, k)]
                for s, ix, t in zip(found.scores, found.documents, tokens, strict=True)]

    def _select(self, scores: np.ndarray, indices: np.ndarray, tokens: list[str], k: int) -> list[int]:
        """Positions of the top ``k`` with positive score, ties by position (rescoring when a tie crosses k)."""
        if len(scores) > k and scores[k - 1] > 0 and scores[k - 1] == scores[k]:
            full = np.asarray(self._model.get_scores(tokens))
            indices = np.flatnonzero(full >= scores[k - 1])
            scores = full[indices]
        order = np.lexsort((indices, -scores))[:k]
        return [int(indices[j]) for j in order if scores[j] > 0]
