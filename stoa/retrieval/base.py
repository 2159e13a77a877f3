"""What a retriever is to the rest of stoa: documents and the ``Searcher`` protocol (no torch, no mlx)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Doc:
    """One document of a corpus."""

    id: str
    """Stable id, unique in the corpus."""
    title: str
    """Title (may be empty)."""
    text: str
    """Body text."""


@runtime_checkable
class Searcher(Protocol):
    """Answers batches of queries with the top-k documents of one corpus."""

    fingerprint: str
    """Identity of the corpus and index settings: every worker and the trainer must search the same one."""

    def search(self, queries: Sequence[str], k: int) -> list[list[Doc]]:
        """The ``k`` best documents for each query, best first.

        Args:
            queries: query texts.
            k: documents per query.

        Raises:
            stoa.envs.ToolUnavailable: the searcher cannot answer now (e.g. an unreachable endpoint).
        """
        ...
