"""A fault-injecting HTTP proxy on 127.0.0.1, for putting a flaky network in front of a test S3 server.

Each request draws (from one seeded generator) at most one fault:

- ``error_5xx``: answer 500 or 503 with an S3 error body; nothing reaches the store.
- ``latency``: wait up to ``max_latency_s`` before forwarding (the request then succeeds).
- ``cut_body``: forward, then send the headers and half the body of the answer and close the
  connection (GETs with a body of at least 2 bytes only).
- ``drop_after_write``: forward a write (PUT/POST/DELETE) so the store applies it, then reset the
  connection without answering; the client cannot tell whether the write happened.

Only loopback addresses are used on either side. The proxy is bounded: request bodies up to
``max_body_bytes``, at most ``max_connections`` client connections, idle connections time out, and
it stops by itself after ``lifetime_s``.
"""

from __future__ import annotations

import http.client
import ipaddress
import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

FAULT_KINDS = ("error_5xx", "latency", "cut_body", "drop_after_write")
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
               "te", "trailer", "trailers", "transfer-encoding", "upgrade", "expect"}
_WRITES = ("PUT", "POST", "DELETE")
_ERROR_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
               b"<Message>injected by the fault proxy</Message></Error>")


@dataclass(frozen=True)
class FaultRates:
    """Probability of each fault per request it applies to (their sum must stay below 1).

    Args:
        error_5xx: answer 500/503 without forwarding.
        latency: delay before forwarding.
        cut_body: cut the answer's body mid-way (GET only).
        drop_after_write: forward a write, then reset the connection (PUT/POST/DELETE only).
        max_latency_s: upper bound of one injected delay.
    """

    error_5xx: float = 0.0
    latency: float = 0.0
    cut_body: float = 0.0
    drop_after_write: float = 0.0
    max_latency_s: float = 0.3

    def applicable(self, method: str) -> list[tuple[str, float]]:
        """The faults that can hit a request with this method, with their probabilities.

        Args:
            method: the HTTP method.
        """
        kinds = [("error_5xx", self.error_5xx), ("latency", self.latency)]
        if method == "GET":
            kinds.append(("cut_body", self.cut_body))
        if method in _WRITES:
            kinds.append(("drop_after_write", self.drop_after_write))
        return kinds


NO_FAULTS = FaultRates()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class FaultProxy:
    """Forward HTTP requests to ``upstream`` (a loopback URL), injecting seeded faults.

    Use as a context manager, or call ``start``/``stop``. ``url`` is the proxy's endpoint.

    Args:
        upstream: ``http://127.0.0.1:PORT`` of the real server.
        rates: fault probabilities (change later with ``set_rates``).
        seed: seed of the fault generator.
        lifetime_s: the proxy stops itself after this long.
        max_connections: client connections served at once (more wait, then are refused).
        max_body_bytes: larger request bodies get 413.
        idle_timeout_s: an idle client connection is closed after this long.
        label: optional ``(method, path) -> label``; faults are then also counted as ``<kind>@<label>``.
    """

    def __init__(self, upstream: str, rates: FaultRates = NO_FAULTS, *, seed: int = 0, lifetime_s: float = 600.0,
                 max_connections: int = 64, max_body_bytes: int = 256 << 20, idle_timeout_s: float = 30.0,
                 label: Callable[[str, str], str] | None = None):
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or not _is_loopback(parts.hostname) or not parts.port:
            raise ValueError(f"upstream must be http://<loopback address>:<port>, got {upstream!r}")
        self.upstream = (parts.hostname, parts.port)
        self.rates = rates
        self.lifetime_s, self.max_body_bytes, self.idle_timeout_s = lifetime_s, max_body_bytes, idle_timeout_s
        self.label = label
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._server: _Server | None = None
        self._threads: list[threading.Thread] = []
        self._timer: threading.Timer | None = None

    @property
    def url(self) -> str:
        """The proxy's endpoint, ``http://127.0.0.1:PORT``."""
        if self._server is None:
            raise RuntimeError("the proxy is not running")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def counts(self) -> dict[str, int]:
        """Requests seen and faults injected so far, by kind (also ``<kind>/<METHOD>``)."""
        with self._lock:
            return dict(self._counts)

    def set_rates(self, rates: FaultRates) -> None:
        """Change the fault probabilities for later requests.

        Args:
            rates: the new probabilities.
        """
        with self._lock:
            self.rates = rates

    def draw(self, method: str) -> tuple[str | None, float]:
        """Pick this request's fault (or None) and, for latency, its delay; counts the request.

        Args:
            method: the HTTP method.
        """
        with self._lock:
            self._counts["requests"] += 1
            u, delay = self._rng.random(), self._rng.uniform(0.0, self.rates.max_latency_s)
            edge = 0.0
            for kind, p in self.rates.applicable(method):
                edge += p
                if u < edge:
                    return kind, delay
            return None, 0.0

    def count(self, kind: str, method: str, path: str) -> None:
        """Record one injected fault.

        Args:
            kind: one of ``FAULT_KINDS``.
            method: the request's HTTP method.
            path: the request target.
        """
        label = self.label(method, path) if self.label is not None else None
        with self._lock:
            self._counts[kind] += 1
            self._counts[f"{kind}/{method}"] += 1
            if label is not None:
                self._counts[f"{kind}@{label}"] += 1

    def start(self) -> FaultProxy:
        """Listen on a free 127.0.0.1 port and serve in a background thread."""
        server = _Server(("127.0.0.1", 0), _Handler, self)
        self._server = server
        t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True,
                             name="fault-proxy")
        t.start()
        self._threads.append(t)
        self._timer = threading.Timer(self.lifetime_s, self.stop)
        self._timer.daemon = True
        self._timer.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the listening socket (idempotent)."""
        server, self._server = self._server, None
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.cancel()
        if server is not None:
            server.shutdown()
            server.server_close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], proxy: FaultProxy):
        self.proxy = proxy
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:  # noqa: ANN001 - socketserver signature
        if not self.proxy._slots.acquire(timeout=10):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.proxy._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:  # noqa: ANN001
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.proxy._slots.release()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    _upstream: http.client.HTTPConnection | None = None

    def setup(self) -> None:
        self.timeout = self.server.proxy.idle_timeout_s
        super().setup()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - base class signature
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        self._serve()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _serve(self) -> None:
        proxy = self.server.proxy
        body = self._read_body()
        if body is None:
            return
        kind, delay = proxy.draw(self.command)
        if kind == "error_5xx":
            status = 503 if delay < proxy.rates.max_latency_s / 2 else 500
            code = b"SlowDown" if status == 503 else b"InternalError"
            self._answer(status, {"Content-Type": "application/xml"}, _ERROR_BODY.replace(b"{code}", code))
            proxy.count(kind, self.command, self.path)
            return
        if kind == "latency":
            time.sleep(delay)
            proxy.count(kind, self.command, self.path)
        try:
            status, reason, headers, payload = self._forward(body)
        except OSError:
            self._answer(502, {}, b"upstream unreachable")
            return
        if kind == "drop_after_write":
            proxy.count(kind, self.command, self.path)
            self._reset()
            return
        if kind == "cut_body" and len(payload) >= 2:
            proxy.count(kind, self.command, self.path)
            self._answer(status, headers, payload, reason=reason, cut=len(payload) // 2)
            return
        self._answer(status, headers, payload, reason=reason)

    def _read_body(self) -> bytes | None:
        limit = self.server.proxy.max_body_bytes
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks, total = [], 0
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                total += size
                if total > limit:
                    self._answer(413, {}, b"request body too large", close=True)
                    return None
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        if length > limit:
            self._answer(413, {}, b"request body too large", close=True)
            return None
        return self.rfile.read(length) if length else b""

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        """Send the request upstream (reconnecting once on a stale connection); return the whole answer."""
        for attempt in range(2):
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(*self.server.proxy.upstream, timeout=120)
            conn = self._upstream
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                        conn.putheader(name, value)
                if body or self.command in _WRITES:
                    conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body or None)
                resp = conn.getresponse()
                payload = resp.read()
                headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP]
                if resp.will_close:
                    conn.close()
                    self._upstream = None
                return resp.status, resp.reason, headers, payload
            except (OSError, http.client.HTTPException):
                conn.close()
                self._upstream = None
                if attempt:
                    raise OSError("upstream failed twice") from None
        raise AssertionError("unreachable")

    def _answer(self, status: int, headers: dict[str, str] | list[tuple[str, str]], payload: bytes, *,
                reason: str | None = None, cut: int | None = None, close: bool = False) -> None:
        items = headers.items() if isinstance(headers, dict) else headers
        self.send_response_only(status, reason)
        for name, value in items:
            if name.lower() != "content-length" or self.command == "HEAD":
                self.send_header(name, value)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(payload)))
        if close or cut is not None:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD" and status not in (204, 304):
            self.wfile.write(payload if cut is None else payload[:cut])
        self.wfile.flush()
        if cut is not None:
            self._reset()

    def _reset(self) -> None:
        """Abort the client connection with a TCP reset (no answer, or the rest of one, ever arrives)."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        if self._upstream is not None:
            self._upstream.close()
            self._upstream = None
