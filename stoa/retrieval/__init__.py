"""Retrieval for search agents: BM25 indexes (bm25s), a shared HTTP endpoint, and the ``search`` tool.

- ``read_corpus(path)``: documents of a jsonl corpus (``CorpusError`` names a bad line).
- ``BM25Index``: ``build(docs)``, ``save(dir)``, ``load(dir, mmap=True)``, ``search(queries, k)``, ``fingerprint``.
- ``SearchTools(searcher, k)``: the ``search`` tool of an environment (one batched search per round).
- ``HTTPSearcher(url)`` / ``make_server(searcher)``: the shared endpoint (``stoa retriever serve``).
- ``upload_index`` / ``download_index`` / ``open_searcher``: the run's index through the bucket.

bm25s is imported only when an index is built or loaded; nothing here imports torch or mlx.
"""

from stoa.retrieval.base import Doc, Searcher
from stoa.retrieval.bm25 import BadIndex, BM25Index, IndexSettings, corpus_fingerprint, verify_index_dir
from stoa.retrieval.client import HTTPSearcher, RetrieverError, RetrieverMismatch
from stoa.retrieval.corpus import CorpusError, read_corpus
from stoa.retrieval.server import RequestLimits, RetrieverServer, make_server
from stoa.retrieval.tools import SearchTools, render_docs
from stoa.retrieval.travel import default_index_cache, download_index, open_searcher, upload_index

__all__ = [
    "BM25Index",
    "BadIndex",
    "CorpusError",
    "Doc",
    "HTTPSearcher",
    "IndexSettings",
    "RequestLimits",
    "RetrieverError",
    "RetrieverMismatch",
    "RetrieverServer",
    "SearchTools",
    "Searcher",
    "corpus_fingerprint",
    "default_index_cache",
    "download_index",
    "make_server",
    "open_searcher",
    "read_corpus",
    "render_docs",
    "upload_index",
    "verify_index_dir",
]
