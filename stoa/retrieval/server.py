"""``stoa retriever serve``: one shared search endpoint (stdlib HTTP) for workers that cannot hold the index.

``GET /health`` -> ``{"ok": true, "fingerprint": ..., "docs": N}``;
``POST /search`` with ``{"queries": [...], "k": 3}`` -> ``{"fingerprint": ..., "results": [[{"id", "title",
"text"}, ...], ...]}``. Requests are bounded (body size, queries per request, ``k``, characters per query);
bad input gets ``400`` with a one-line JSON ``{"error": ...}`` and the server keeps serving. Searches run one
batch at a time (a batch is already one bm25s call). No torch, no mlx.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from stoa.retrieval.base import Searcher

__all__ = ["RequestLimits", "RetrieverServer", "SearchRequest", "make_server", "parse_search_request"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestLimits:
    """Bounds of one ``POST /search``."""

    max_body_bytes: int = 1 << 20
    """Largest request body (1 MiB)."""
    max_queries: int = 1024
    """Queries per request."""
    max_k: int = 50
    """Largest ``k``."""
    max_query_chars: int = 4096
    """Characters per query."""


@dataclass(frozen=True)
class SearchRequest:
    """A valid ``POST /search`` body."""

    queries: list[str]
    k: int


def parse_search_request(body: bytes, limits: RequestLimits) -> SearchRequest:
    """Decode and check a ``POST /search`` body.

    Args:
        body: the request body.
        limits: the bounds.

    Raises:
        ValueError: one line naming the field and the bound.
    """
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"body is not JSON ({e}); send {{\"queries\": [...], \"k\": 3}}") from None
    if not isinstance(obj, dict):
        raise ValueError("body must be a JSON object {\"queries\": [...], \"k\": 3}")
    queries, k = obj.get("queries"), obj.get("k", 3)
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise ValueError("queries: must be a list of strings")
    if len(queries) > limits.max_queries:
        raise ValueError(f"queries: {len(queries)} in one request, at most {limits.max_queries}; split the batch")
    if any(len(q) > limits.max_query_chars for q in queries):
        raise ValueError(f"queries: a query is longer than {limits.max_query_chars} characters")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= limits.max_k:
        raise ValueError(f"k: must be an integer in [1, {limits.max_k}], got {k!r}")
    return SearchRequest(queries, k)


class RetrieverServer(ThreadingHTTPServer):
    """A threading HTTP server answering ``/health`` and ``/search`` from one searcher.

    Args:
        address: ``(host, port)``; port 0 picks a free one (see ``server_address``).
        searcher: what answers the queries.
        limits: request bounds.
    """

    daemon_threads = True

    def __init__(self, address: tuple[str, int], searcher: Searcher, limits: RequestLimits | None = None):
        self.searcher = searcher
        self.limits = limits or RequestLimits()
        self.search_lock = threading.Lock()
        self.requests_served = 0
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        """``http://host:port`` of the listening socket."""
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def health(self) -> dict[str, Any]:
        """The ``GET /health`` answer."""
        docs = len(self.searcher) if hasattr(self.searcher, "__len__") else None  # type: ignore[arg-type]
        return {"ok": True, "fingerprint": self.searcher.fingerprint, "docs": docs}

    def answer(self, request: SearchRequest) -> dict[str, Any]:
        """The ``POST /search`` answer.

        Args:
            request: a checked request.
        """
        with self.search_lock:
            found = self.searcher.search(request.queries, request.k)
            self.requests_served += 1
        results = [[{"id": d.id, "title": d.title, "text": d.text} for d in docs] for docs in found]
        return {"fingerprint": self.searcher.fingerprint, "results": results}


class _Handler(BaseHTTPRequestHandler):
    server: RetrieverServer
    server_version = "stoa-retriever/1"
    timeout = 30

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - BaseHTTPRequestHandler's name
        log.debug("%s %s", self.address_string(), format % args)

    def _reply(self, code: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode("utf-8")
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if code >= 400:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.split("?")[0] != "/health":
            self._reply(404, {"error": f"no such path {self.path!r}; use GET /health or POST /search"})
            return
        self._reply(200, self.server.health())

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        if self.path.split("?")[0] != "/search":
            self._reply(404, {"error": f"no such path {self.path!r}; use POST /search"})
            return
        limits = self.server.limits
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._reply(400, {"error": "Content-Length missing or not a number; send a JSON body"})
            return
        if length < 0 or length > limits.max_body_bytes:
            self._reply(400, {"error": f"body of {length} bytes, at most {limits.max_body_bytes}; split the batch"})
            return
        try:
            request = parse_search_request(self.rfile.read(length), limits)
        except ValueError as e:
            self._reply(400, {"error": str(e)})
            return
        try:
            answer = self.server.answer(request)
        except Exception as e:  # the endpoint must survive any one request
            log.exception("search failed")
            first = str(e).splitlines()[0] if str(e) else ""
            self._reply(500, {"error": f"search failed: {type(e).__name__}: {first}"})
            return
        self._reply(200, answer)


def make_server(searcher: Searcher, host: str = "127.0.0.1", port: int = 0,
                limits: RequestLimits | None = None) -> RetrieverServer:
    """A bound (not yet serving) server; call ``serve_forever()`` (a thread in tests) and ``shutdown()``.

    Args:
        searcher: what answers the queries.
        host: interface to listen on (default loopback only).
        port: TCP port (0: any free one).
        limits: request bounds.
    """
    return RetrieverServer((host, port), searcher, limits)
