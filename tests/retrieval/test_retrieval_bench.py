"""``stoa bench retriever`` on a small synthetic corpus: every figure is there and plausible."""

from __future__ import annotations

from stoa.bench.retriever import make_queries, run_retriever_bench, synthetic_corpus
from stoa.cli.bench import bench_parser


def test_bench_reports_queries_per_second_and_memory():
    lines: list[str] = []
    out = run_retriever_bench("synthetic", n_docs=300, n_queries=40, k=3, batch=8, echo=lines.append)
    assert out["docs"] == 300 and out["queries"] == 40
    for key in ("qps_batched", "qps_single", "http_qps_batched", "http_qps_single", "build_s"):
        assert out[key] > 0, key
    assert out["index_bytes"] > 300 * 40  # at least the documents themselves
    assert out["rss_kind"] in ("rss", "peak")
    assert len(lines) == 3


def test_queries_and_corpus_are_seeded():
    docs = synthetic_corpus(50, seed=3)
    assert docs == synthetic_corpus(50, seed=3) != synthetic_corpus(50, seed=4)
    assert make_queries(docs, 10, seed=1) == make_queries(docs, 10, seed=1)


def test_registered_with_its_flags():
    parser = bench_parser("retriever")
    assert parser is not None
    args = parser.parse_args(["--corpus", "synthetic", "--docs", "10", "--no-http"])
    assert (args.corpus, args.docs, args.no_http) == ("synthetic", 10, True)
