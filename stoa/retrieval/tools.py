"""The ``search`` tool: every call of a round answered by one ``Searcher.search``, rendered as Search-R1 does.

A result reads ``Doc 1(Title: t) text\\nDoc 2(Title: t) text\\n`` (Search-R1's ``_passages2string``), each
document's text cut at ``max_doc_chars`` so an observation stays short. The digest is
``result_hash`` of exactly what was rendered (id, title and shown text of each document), so a replay names
the call whose result differs. A call of any other tool gets a fixed refusal, so a model that invents tools
still gets a deterministic observation. No torch, no mlx.
"""

from __future__ import annotations

from collections.abc import Sequence

from stoa.envs.base import ToolResult, result_hash
from stoa.retrieval.base import Doc, Searcher
from stoa.rollouts.episode import ToolCall

__all__ = ["NO_RESULTS_TEXT", "SEARCH_TOOL", "SearchTools", "UNKNOWN_TOOL_TEXT", "render_docs"]

SEARCH_TOOL = "search"
"""The tool's name in ``ToolCall.name``."""
UNKNOWN_TOOL_TEXT = "Unknown tool: the only tool is search.\n"
"""What a call of another tool returns."""
NO_RESULTS_TEXT = "No documents found.\n"
"""What a query that matches no document returns."""
TRUNCATION_MARK = " ..."
"""Appended to a document text cut at ``max_doc_chars``."""


def render_docs(docs: Sequence[Doc], max_doc_chars: int, max_title_chars: int = 200) -> ToolResult:
    """Search-R1's rendering of retrieved documents, with the digest of what was shown.

    Args:
        docs: the documents, best first.
        max_doc_chars: characters of each document's text shown (longer ones end with ``" ..."``).
        max_title_chars: characters of each title shown.
    """
    if not docs:
        return ToolResult(NO_RESULTS_TEXT, result_hash([NO_RESULTS_TEXT]))
    lines, parts = [], []
    for i, doc in enumerate(docs, start=1):
        title = doc.title[:max_title_chars]
        text = doc.text if len(doc.text) <= max_doc_chars else doc.text[:max_doc_chars].rstrip() + TRUNCATION_MARK
        lines.append(f"Doc {i}(Title: {title}) {text}\n")
        parts += [doc.id, title, text]
    return ToolResult("".join(lines), result_hash(parts))


class SearchTools:
    """``stoa.envs.Tools`` for the ``search`` tool.

    Args:
        searcher: the corpus (a ``BM25Index``, an ``HTTPSearcher``, ...).
        k: documents per query.
        max_doc_chars: characters of each document's text shown.
        max_query_chars: a longer query is cut to this many characters before searching.
    """

    def __init__(self, searcher: Searcher, k: int = 3, max_doc_chars: int = 480, max_query_chars: int = 500):
        for name, value in (("k", k), ("max_doc_chars", max_doc_chars), ("max_query_chars", max_query_chars)):
            if int(value) < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        self.searcher = searcher
        self.k = int(k)
        self.max_doc_chars = int(max_doc_chars)
        self.max_query_chars = int(max_query_chars)

    @property
    def fingerprint(self) -> str:
        """The searcher's corpus fingerprint."""
        return self.searcher.fingerprint

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """One result per call, in order; all ``search`` calls go to the searcher in one batch.

        Args:
            calls: the calls of every paused row.

        Raises:
            stoa.envs.ToolUnavailable: the searcher cannot answer (nothing is returned then).
        """
        asked = [i for i, c in enumerate(calls) if c.name == SEARCH_TOOL]
        found = self.searcher.search([calls[i].arguments.strip()[:self.max_query_chars] for i in asked],
                                     self.k) if asked else []
        if len(found) != len(asked):
            raise RuntimeError(f"searcher answered {len(found)} of {len(asked)} queries")
        refusal = ToolResult(UNKNOWN_TOOL_TEXT, result_hash([UNKNOWN_TOOL_TEXT]))
        results = [refusal] * len(calls)
        for i, docs in zip(asked, found, strict=True):
            results[i] = render_docs(docs[:self.k], self.max_doc_chars)
        return results
