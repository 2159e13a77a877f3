"""``stoa retriever``: build a BM25 index of a corpus, serve it to a fleet, upload it to a run, try a query."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from stoa.bucket import open_bucket
from stoa.envs import ToolUnavailable
from stoa.retrieval import (
    BadIndex,
    BM25Index,
    CorpusError,
    RetrieverError,
    SearchTools,
    make_server,
    open_searcher,
    read_corpus,
    upload_index,
)
from stoa.rollouts.episode import ToolCall

EXIT_BAD_INPUT = 2
"""Exit code of a bad corpus, index directory or flag (``EXIT_CODES`` in stoa.cli)."""
EXIT_UNREACHABLE = 5
"""Exit code of an endpoint that stayed unreachable (``EXIT_CODES``: timed out waiting)."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``retriever index|serve|upload|search``.

    Args:
        sub: the top-level subparsers.
    """
    p = sub.add_parser("retriever", help="build, serve and upload the BM25 index of search tasks",
                       description="The retriever of search tasks: a bm25s index built once from a jsonl corpus "
                                   "(one document per line: id, title, text or Search-R1's contents), searched "
                                   "in-process, through a shared endpoint, or downloaded from the run's bucket.")
    cmds = p.add_subparsers(dest="retriever_command", metavar="COMMAND")
    cmds.required = True
    ix = cmds.add_parser("index", help="build an index of CORPUS.jsonl into OUT",
                         description="Read CORPUS.jsonl, build a BM25 index and save it into OUT (new or empty); "
                                     "prints the fingerprint the run's contract will name.")
    ix.add_argument("corpus", metavar="CORPUS.jsonl", help="one JSON document per line: id, title, text")
    ix.add_argument("out", metavar="OUT", help="index directory to create (must be new or empty)")
    ix.set_defaults(func=run_index)
    sv = cmds.add_parser("serve", help="serve an index over HTTP (GET /health, POST /search)",
                         description="One shared search endpoint for workers that cannot hold the index; select "
                                     "it with --retriever http://HOST:PORT. Requests are bounded: 1 MiB body, "
                                     "1024 queries, k <= 50.")
    sv.add_argument("--index", required=True, metavar="DIR", help="index directory (stoa retriever index)")
    sv.add_argument("--host", default="127.0.0.1", help="interface to listen on; 0.0.0.0 for the whole network "
                                                       "[default: '127.0.0.1']")
    sv.add_argument("--port", type=int, default=8391, help="TCP port [default: 8391]")
    sv.set_defaults(func=run_serve)
    up = cmds.add_parser("upload", help="upload an index under a run (create-only; the contract names it)",
                         description="Upload an index directory to runs/<run>/retriever/<fingerprint>/ of the "
                                     "bucket, manifest last, so workers can download it.")
    up.add_argument("index", metavar="DIR", help="index directory (stoa retriever index)")
    up.add_argument("--bucket", required=True, help="bucket URL or local directory of the run")
    up.add_argument("--run", required=True, help="run id")
    up.set_defaults(func=run_upload)
    se = cmds.add_parser("search", help="print the top documents of a query",
                         description="Search an index directory or an endpoint and print what the search tool "
                                     "would show the model.")
    se.add_argument("query", help="the query text")
    se.add_argument("--index", metavar="DIR_OR_URL", required=True, help="index directory or http://HOST:PORT")
    se.add_argument("-k", type=int, default=3, help="documents [default: 3]")
    se.set_defaults(func=run_search)


def _refuse(command: str, message: str) -> int:
    print(f"stoa retriever {command}: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def run_index(args: argparse.Namespace) -> int:
    """Build and save an index, printing progress and the fingerprint.

    Args:
        args: parsed arguments.
    """

    corpus, out = Path(args.corpus), Path(args.out)
    if not corpus.is_file():
        return _refuse("index", f"{corpus}: no such file; give a jsonl corpus (one document per line)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        return _refuse("index", f"{out} exists and is not an empty directory; choose a new OUT")
    t0 = time.perf_counter()
    print(f"[retriever] reading {corpus}", flush=True)
    try:
        index = BM25Index.build(read_corpus(corpus), progress=lambda n: print(f"[retriever] read {n} documents",
                                                                              flush=True))
    except CorpusError as e:
        return _refuse("index", str(e))
    print(f"[retriever] indexed {len(index)} documents in {time.perf_counter() - t0:.1f}s", flush=True)
    index.save(out)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"[retriever] saved {out} ({size / 1e6:.1f} MB); fingerprint {index.fingerprint}")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    """Serve an index until interrupted.

    Args:
        args: parsed arguments.
    """

    try:
        index = BM25Index.load(args.index, mmap=True)
    except BadIndex as e:
        return _refuse("serve", str(e))
    try:
        server = make_server(index, args.host, args.port)
    except OSError as e:
        return _refuse("serve", f"cannot listen on {args.host}:{args.port} ({e}); choose another --port")
    print(f"[retriever] serving {len(index)} documents (index {index.fingerprint}) at {server.url}; "
          f"workers use --retriever {server.url}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


def run_upload(args: argparse.Namespace) -> int:
    """Upload an index under a run and print its fingerprint.

    Args:
        args: parsed arguments.
    """

    try:
        fingerprint = upload_index(open_bucket(args.bucket), args.run, args.index)
    except BadIndex as e:
        return _refuse("upload", str(e))
    print(f"[retriever] index {fingerprint} is in {args.bucket} under run {args.run!r}")
    return 0


def run_search(args: argparse.Namespace) -> int:
    """Print the search tool's result for one query.

    Args:
        args: parsed arguments.
    """

    where = args.index
    try:
        searcher = open_searcher(url=where if where.startswith(("http://", "https://")) else None,
                                 index_dir=None if where.startswith(("http://", "https://")) else where,
                                 retry_seconds=5.0)
        result = SearchTools(searcher, k=args.k).run([ToolCall("search", args.query)])[0]
    except (BadIndex, RetrieverError, ValueError) as e:
        return _refuse("search", str(e))
    except ToolUnavailable as e:
        print(f"stoa retriever search: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    print(result.text, end="")
    return 0
