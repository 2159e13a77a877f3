"""SearchTools: one search per round, Search-R1 rendering, digests of what was shown, refusals."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from stoa.envs import ToolResult, Tools, result_hash
from stoa.retrieval import Doc, SearchTools, render_docs
from stoa.retrieval.tools import NO_RESULTS_TEXT, UNKNOWN_TOOL_TEXT
from stoa.rollouts.episode import ToolCall


class CountingSearcher:
    """A searcher that records every batch and answers each query with fixed documents."""

    fingerprint = "f" * 32

    def __init__(self, docs: list[Doc]):
        self.docs = docs
        self.batches: list[tuple[list[str], int]] = []

    def search(self, queries: Sequence[str], k: int) -> list[list[Doc]]:
        self.batches.append((list(queries), k))
        return [self.docs[:k] if q else [] for q in queries]


DOCS = [Doc("a", "Ada", "Ada wrote the first program."), Doc("b", "Grace", "x" * 50), Doc("c", "C", "third")]


def test_all_calls_of_a_round_go_in_one_search():
    searcher = CountingSearcher(DOCS)
    tools = SearchTools(searcher, k=2, max_doc_chars=20)
    assert isinstance(tools, Tools)
    calls = [ToolCall("search", " who wrote "), ToolCall("lookup", "x"), ToolCall("search", "")]
    results = tools.run(calls)
    assert searcher.batches == [(["who wrote", ""], 2)]
    assert results[0].text == "Doc 1(Title: Ada) Ada wrote the first ...\nDoc 2(Title: Grace) " + "x" * 20 + " ...\n"
    assert results[0].digest == result_hash(["a", "Ada", "Ada wrote the first ...", "b", "Grace", "x" * 20 + " ..."])
    assert results[1] == ToolResult(UNKNOWN_TOOL_TEXT, result_hash([UNKNOWN_TOOL_TEXT]))
    assert results[2] == ToolResult(NO_RESULTS_TEXT, result_hash([NO_RESULTS_TEXT]))


def test_only_refusals_need_no_search():
    searcher = CountingSearcher(DOCS)
    assert SearchTools(searcher).run([ToolCall("calc", "1+1")])[0].text == UNKNOWN_TOOL_TEXT
    assert searcher.batches == []
    assert SearchTools(searcher).run([]) == []


def test_digest_changes_with_what_was_shown_only():
    short = render_docs(DOCS[:1], max_doc_chars=10)
    assert short.digest == render_docs([Doc("a", "Ada", "Ada wrote DIFFERENT text")], max_doc_chars=10).digest
    assert short.digest != render_docs([Doc("z", "Ada", "Ada wrote the first program.")], max_doc_chars=10).digest
    assert render_docs(DOCS[:1], 100).text == "Doc 1(Title: Ada) Ada wrote the first program.\n"


def test_long_queries_are_cut_and_settings_checked():
    searcher = CountingSearcher(DOCS)
    SearchTools(searcher, max_query_chars=5).run([ToolCall("search", "abcdefgh")])
    assert searcher.batches[0][0] == ["abcde"]
    with pytest.raises(ValueError, match="k: must be >= 1"):
        SearchTools(searcher, k=0)


def test_searcher_answering_too_few_is_an_error():
    class Short(CountingSearcher):
        def search(self, queries, k):
            return []

    with pytest.raises(RuntimeError, match="answered 0 of 1"):
        SearchTools(Short(DOCS)).run([ToolCall("search", "q")])


def test_real_index_renders_its_best_document(index):
    result = SearchTools(index, k=1).run([ToolCall("search", "code zq7x")])[0]
    assert result.text == "Doc 1(Title: Entity 7) The entity 7 lives near the river mountain. Its code is zq7x.\n"
