"""Retrieval for search agents: BM25 indexes (bm25s), a shared HTTP endpoint, and the ``search`` tool."""

from stoa.retrieval.base import Doc, Searcher

__all__ = ["Doc", "Searcher"]
