"""``HTTPSearcher``: the client of ``stoa retriever serve`` (stdlib urllib).

An unreachable endpoint (refused connection, timeout, HTTP 429/5xx) is retried with jittered exponential
backoff for ``retry_seconds``, with one message saying so; after that ``stoa.envs.ToolUnavailable`` is raised
and nothing is returned (never a partial batch). A refusal (HTTP 400/404) or a malformed answer is not
retried: ``RetrieverError``. An endpoint serving another corpus than the expected fingerprint raises
``RetrieverMismatch`` (a ``ContractMismatch``: the run's contract names the corpus). No torch, no mlx.
"""

from __future__ import annotations

import http.client
import json
import random
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from stoa.contract import ContractMismatch
from stoa.envs.base import ToolUnavailable
from stoa.retrieval.base import Doc

__all__ = ["HTTPSearcher", "RetrieverError", "RetrieverMismatch"]

_TRANSIENT_HTTP = (408, 429, 500, 502, 503, 504)
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""No proxies: a retriever is a fleet-internal endpoint, and a proxy variable must not reroute it."""


class RetrieverError(RuntimeError):
    """The endpoint refused a request or answered something that is not a search answer."""


class RetrieverMismatch(ContractMismatch):
    """The endpoint serves another corpus than the run's (fingerprints differ)."""

    def __init__(self, url: str, expected: str, served: str):
        super().__init__(["retriever.fingerprint"], f"retriever at {url} serves index {served}, the run searches "
                         f"{expected}; point --retriever at a server of the run's index")


class HTTPSearcher:
    """A ``Searcher`` answering through a shared endpoint.

    Args:
        url: ``http://host:port`` of ``stoa retriever serve``.
        fingerprint: the corpus the caller expects; None asks the endpoint now (``GET /health``, retried like a
            search) and pins what it serves.
        retry_seconds: how long an unreachable endpoint is retried before ``ToolUnavailable``.
        timeout_s: socket timeout of one request.
        note: where the "unreachable, retrying" message goes.
        max_batch: queries per request (larger batches are split; all parts must succeed).
    """

    def __init__(self, url: str, fingerprint: str | None = None, retry_seconds: float = 60.0, timeout_s: float = 30.0,
                 note: Callable[[str], Any] = print, max_batch: int = 256):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"retriever URL {url!r}: must start with http:// or https://")
        self.url = url.rstrip("/")
        self.retry_seconds = float(retry_seconds)
        self.timeout_s = float(timeout_s)
        self.note = note
        self.max_batch = int(max_batch)
        self.fingerprint = fingerprint or ""
        if not self.fingerprint:
            self.health()

    def health(self) -> dict[str, Any]:
        """The endpoint's ``GET /health`` answer (retried like a search; a mismatching fingerprint raises
        ``RetrieverMismatch``)."""
        answer = self._request("GET", "/health", None)
        self._check(answer.get("fingerprint"))
        return answer

    def search(self, queries: Sequence[str], k: int) -> list[list[Doc]]:
        """The ``k`` best documents of each query, from the endpoint.

        Args:
            queries: query texts.
            k: documents per query.

        Raises:
            ToolUnavailable: the endpoint stayed unreachable for ``retry_seconds``.
            RetrieverMismatch: the endpoint serves another corpus.
            RetrieverError: the endpoint refused the request or answered garbage.
        """
        out: list[list[Doc]] = []
        for start in range(0, len(queries), self.max_batch):
            part = list(queries[start:start + self.max_batch])
            answer = self._request("POST", "/search", json.dumps({"queries": part, "k": k}).encode("utf-8"))
            self._check(answer.get("fingerprint"))
            out += _docs_of(answer, len(part), k, self.url)
        return out

    def _check(self, served: Any) -> None:
        if not isinstance(served, str) or not served:
            raise RetrieverError(f"retriever at {self.url} answered without a fingerprint; is it stoa retriever serve?")
        if not self.fingerprint:
            self.fingerprint = served
        elif served != self.fingerprint:
            raise RetrieverMismatch(self.url, self.fingerprint, served)

    def _request(self, method: str, path: str, body: bytes | None) -> dict[str, Any]:
        """One request, retried while the endpoint is unreachable; the decoded JSON object."""
        deadline = time.monotonic() + self.retry_seconds
        delay, noted = 0.2, False
        while True:
            try:
                return self._once(method, path, body)
            except _Transient as e:
                reason = str(e)
            left = deadline - time.monotonic()
            if left <= 0:
                raise ToolUnavailable(f"retriever at {self.url} unreachable ({reason}) for {self.retry_seconds:g} s; "
                                      "start it (stoa retriever serve) or check --retriever")
            if not noted:
                self.note(f"retriever at {self.url} unreachable ({reason}); retrying for up to "
                          f"{self.retry_seconds:g} s")
                noted = True
            time.sleep(min(left, delay * (0.5 + random.random() / 2)))
            delay = min(delay * 2, 5.0)

    def _once(self, method: str, path: str, body: bytes | None) -> dict[str, Any]:
        req = urllib.request.Request(self.url + path, data=body, method=method,
                                     headers={"Content-Type": "application/json"} if body is not None else {})
        try:
            with _OPENER.open(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = _error_line(e)
            if e.code in _TRANSIENT_HTTP:
                raise _Transient(f"HTTP {e.code} {detail}") from None
            raise RetrieverError(f"retriever at {self.url} refused {method} {path}: HTTP {e.code} {detail}") from None
        except urllib.error.URLError as e:
            raise _Transient(str(e.reason)) from None
        except (OSError, http.client.HTTPException) as e:
            raise _Transient(f"{type(e).__name__}: {e}") from None
        try:
            answer = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise RetrieverError(f"retriever at {self.url} answered {method} {path} with non-JSON") from None
        if not isinstance(answer, dict):
            raise RetrieverError(f"retriever at {self.url} answered {method} {path} with a non-object")
        return answer


class _Transient(Exception):
    """A failure worth retrying (the endpoint is down, busy or restarting)."""


def _error_line(e: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(e.read()).get("error", ""))[:300]
    except Exception:
        return e.reason if isinstance(e.reason, str) else ""


def _docs_of(answer: dict[str, Any], n: int, k: int, url: str) -> list[list[Doc]]:
    """The documents of a ``/search`` answer, checked against the request."""
    results = answer.get("results")
    if not isinstance(results, list) or len(results) != n:
        raise RetrieverError(f"retriever at {url} answered {n} queries with a malformed 'results'")
    out = []
    for row in results:
        if not isinstance(row, list) or len(row) > k:
            raise RetrieverError(f"retriever at {url} answered a query with more than k={k} documents or a non-list")
        docs = []
        for d in row:
            if not isinstance(d, dict) or not all(isinstance(d.get(f), str) for f in ("id", "title", "text")):
                raise RetrieverError(f"retriever at {url} answered a document without string id, title and text")
            docs.append(Doc(d["id"], d["title"], d["text"]))
        out.append(docs)
    return out
