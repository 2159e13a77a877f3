"""``stoa bench retriever``: BM25 queries/s (batched and one at a time, in-process and through the HTTP
endpoint over loopback) and the index's memory (files on disk, RSS after a memory-mapped load and a search
pass), on the built-in search task's corpus or a generated one."""

from __future__ import annotations

import argparse
import os
import random
import re
import resource
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from stoa.retrieval import BM25Index, Doc, HTTPSearcher, Searcher, make_server, read_corpus

_SYLLABLES = ("ka", "lo", "mi", "nu", "ra", "te", "vo", "zi", "an", "el", "or", "us", "be", "do", "fi", "gu")


def _vocabulary(rng: random.Random, size: int) -> list[str]:
    """``size`` distinct pseudo-words of 2-4 syllables."""
    words: dict[str, None] = {}
    while len(words) < size:
        words["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))] = None
    return list(words)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``stoa bench retriever``.

    Args:
        p: the subcommand's parser.
    """
    p.add_argument("--corpus", default="search",
                   help="'search' (the built-in search task's corpus), 'synthetic' (--docs generated documents) "
                        "or a jsonl corpus file [default: 'search']")
    p.add_argument("--docs", type=int, default=5000, help="documents of the synthetic corpus [default: 5000]")
    p.add_argument("--queries", type=int, default=1024, help="queries to time [default: 1024]")
    p.add_argument("--k", type=int, default=3, help="documents per query [default: 3]")
    p.add_argument("--batch", type=int, default=64, help="queries per batched call [default: 64]")
    p.add_argument("--no-http", action="store_true", help="skip the endpoint (loopback HTTP) figures")
    p.add_argument("--seed", type=int, default=0, help="corpus and query seed [default: 0]")


def synthetic_corpus(n: int, seed: int = 0, vocabulary: int = 20000) -> list[Doc]:
    """``n`` generated documents of 40-80 words drawn Zipf-like from a pseudo-word vocabulary (so posting
    lists are as skewed as in text), each with a unique name.

    Args:
        n: documents.
        seed: generator seed.
        vocabulary: distinct words.
    """
    rng = random.Random(seed)
    words = _vocabulary(rng, vocabulary)
    cum, total = [], 0.0
    for rank in range(len(words)):
        total += 1.0 / (rank + 1)
        cum.append(total)
    return [Doc(f"doc{i}", f"Entity {i} {rng.choice(words)}",
                " ".join(rng.choices(words, cum_weights=cum, k=rng.randint(40, 80))) + f" name{i}")
            for i in range(n)]


def bench_corpus(name: str, n_docs: int, seed: int, echo: Callable[[str], Any] = print) -> list[Doc]:
    """The documents to index.

    Args:
        name: ``search``, ``synthetic`` or a jsonl path.
        n_docs: documents of the synthetic corpus.
        seed: seed of the synthetic corpus.
        echo: where a fallback note goes.
    """
    if name == "search":
        try:
            from stoa.tasks.search import SearchTask  # type: ignore[import-not-found]
        except ImportError:
            echo("[bench] the built-in search task is not available; using a synthetic corpus")
            return synthetic_corpus(n_docs, seed)
        return list(SearchTask().corpus())
    if name == "synthetic":
        return synthetic_corpus(n_docs, seed)
    return list(read_corpus(name))


def make_queries(docs: Sequence[Doc], n: int, seed: int = 0) -> list[str]:
    """``n`` queries of 2-6 words drawn from random documents' titles and texts.

    Args:
        docs: the corpus.
        n: queries.
        seed: generator seed.
    """
    rng = random.Random(seed + 1)
    out = []
    for _ in range(n):
        doc = docs[rng.randrange(len(docs))]
        words = re.findall(r"\w+", f"{doc.title} {doc.text}") or ["x"]
        out.append(" ".join(rng.choice(words) for _ in range(rng.randint(2, 6))))
    return out


def rss_bytes() -> tuple[int, str]:
    """The process's resident memory and what the figure is (``rss`` now, or ``peak`` where /proc is missing)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE"), "rss"
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return (peak if sys.platform == "darwin" else peak * 1024), "peak"


def queries_per_second(searcher: Searcher, queries: Sequence[str], k: int, batch: int) -> tuple[float, float]:
    """``(batched, single)`` queries/s: calls of ``batch`` queries, then one query per call.

    Args:
        searcher: what to time.
        queries: the queries.
        k: documents per query.
        batch: queries per batched call.
    """
    t0 = time.perf_counter()
    for start in range(0, len(queries), batch):
        searcher.search(queries[start:start + batch], k)
    batched = len(queries) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for q in queries:
        searcher.search([q], k)
    return batched, len(queries) / (time.perf_counter() - t0)


def _http_qps(index: BM25Index, queries: Sequence[str], k: int, batch: int) -> tuple[float, float]:
    server = make_server(index, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        return queries_per_second(HTTPSearcher(server.url, index.fingerprint), queries, k, batch)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def run_retriever_bench(corpus: str = "search", n_docs: int = 5000, n_queries: int = 1024, k: int = 3,
                        batch: int = 64, http: bool = True, seed: int = 0,
                        echo: Callable[[str], Any] = print) -> dict[str, Any]:
    """Build, save and load an index, then time queries; print and return the figures.

    Args:
        corpus: ``search``, ``synthetic`` or a jsonl path.
        n_docs: documents of the synthetic corpus.
        n_queries: queries to time.
        k: documents per query.
        batch: queries per batched call.
        http: also time the endpoint over loopback.
        seed: corpus and query seed.
        echo: where lines go.
    """
    docs = bench_corpus(corpus, n_docs, seed, echo)
    queries = make_queries(docs, n_queries, seed)
    t0 = time.perf_counter()
    built = BM25Index.build(docs)
    build_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="stoa-bench-retriever-") as tmp:
        built.save(tmp)
        files = sum(p.stat().st_size for p in Path(tmp).iterdir())
        del built
        rss0, kind = rss_bytes()
        index = BM25Index.load(tmp, mmap=True)
        index.search(queries, k)  # touch the pages a search pass needs
        rss1, _ = rss_bytes()
        batched, single = queries_per_second(index, queries, k, batch)
        http_batched, http_single = _http_qps(index, queries, k, batch) if http else (0.0, 0.0)
    out = {"corpus": corpus, "docs": len(docs), "queries": n_queries, "k": k, "batch": batch, "build_s": build_s,
           "index_bytes": files, "rss_delta_bytes": rss1 - rss0, "rss_kind": kind, "qps_batched": batched,
           "qps_single": single, "http_qps_batched": http_batched, "http_qps_single": http_single}
    echo(f"retriever: {len(docs)} documents ({corpus}), built in {build_s:.2f}s, index files {files / 1e6:.1f} MB, "
         f"{kind} +{(rss1 - rss0) / 1e6:.1f} MB after a memory-mapped load and one search pass")
    echo(f"  in-process: {batched:,.0f} queries/s batched ({batch} per call), {single:,.0f} queries/s single (k={k})")
    if http:
        echo(f"  endpoint (loopback HTTP): {http_batched:,.0f} queries/s batched, {http_single:,.0f} queries/s single")
    return out


def main(args: argparse.Namespace) -> int:
    """Run the benchmark with parsed flags.

    Args:
        args: parsed flags (see ``add_arguments``).
    """
    run_retriever_bench(args.corpus, args.docs, args.queries, args.k, args.batch, http=not args.no_http,
                        seed=args.seed)
    return 0
