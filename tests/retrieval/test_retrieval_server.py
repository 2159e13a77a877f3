"""The shared endpoint over a real loopback socket, and HTTPSearcher against it, a closed port and another
corpus."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from stoa.contract import ContractMismatch
from stoa.envs import ToolUnavailable
from stoa.retrieval import HTTPSearcher, RequestLimits, RetrieverError, RetrieverMismatch, make_server
from stoa.retrieval.server import parse_search_request

from .test_retrieval_bm25 import QUERIES


@pytest.fixture
def server(index) -> Iterator:
    srv = make_server(index, "127.0.0.1", 0, RequestLimits(max_body_bytes=64 << 10, max_queries=8, max_k=5))
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(5)


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/search", data=body, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def raw_request(port: int, head: bytes) -> bytes:
    """Send raw bytes and read the whole answer (the server closes after an error)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(head)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_health_and_search(server, index):
    with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
        assert json.loads(r.read()) == {"ok": True, "fingerprint": index.fingerprint, "docs": len(index)}
    code, answer = post(server.url, json.dumps({"queries": ["code zq7x", "glimmerstone"], "k": 2}).encode())
    assert code == 200 and answer["fingerprint"] == index.fingerprint
    assert [[d["id"] for d in row] for row in answer["results"]] == [["d7", "d0"], ["twin-a", "twin-b"]]


@pytest.mark.parametrize(("body", "words"), [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "JSON object"),
    (json.dumps({"queries": "one"}).encode(), "list of strings"),
    (json.dumps({"queries": [1]}).encode(), "list of strings"),
    (json.dumps({"queries": ["q"] * 9}).encode(), "at most 8"),
    (json.dumps({"queries": ["q"], "k": 6}).encode(), "k: must be"),
    (json.dumps({"queries": ["q"], "k": True}).encode(), "k: must be"),
])
def test_bad_requests_get_400_and_the_server_keeps_serving(server, index, body, words):
    code, answer = post(server.url, body)
    assert code == 400 and words in answer["error"] and "\n" not in answer["error"]
    code, answer = post(server.url, json.dumps({"queries": ["code zq7x"], "k": 1}).encode())
    assert code == 200 and answer["results"][0][0]["id"] == "d7"


def test_oversize_body_refused_without_reading_it(server):
    head = b"POST /search HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n{\"queries\": ["
    answer = raw_request(server.server_address[1], head)
    assert answer.startswith(b"HTTP/1.0 400") or answer.startswith(b"HTTP/1.1 400")
    assert b"at most 65536" in answer
    missing = raw_request(server.server_address[1], b"POST /search HTTP/1.0\r\n\r\n")
    assert b" 400 " in missing.split(b"\r\n")[0] and b"Content-Length" in missing
    assert HTTPSearcher(server.url, retry_seconds=1).search(["glimmerstone"], 1)[0][0].id == "twin-a"


def test_unknown_path_is_404(server):
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(server.url + "/nope", timeout=5)
    assert e.value.code == 404


def test_searcher_failure_is_500_and_not_fatal(index):
    class Broken:
        fingerprint = index.fingerprint

        def search(self, queries, k):
            raise RuntimeError("disk gone\nsecond line")

    srv = make_server(Broken(), "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
    try:
        assert post(srv.url, b'{"queries": ["q"]}') == (500, {"error": "search failed: RuntimeError: disk gone"})
        assert post(srv.url, b'{"queries": ["q"]}')[0] == 500
    finally:
        srv.shutdown()
        srv.server_close()


def test_http_searcher_equals_the_index_and_splits_batches(server, index):
    searcher = HTTPSearcher(server.url, fingerprint=index.fingerprint, max_batch=3)
    assert searcher.search(QUERIES, 4) == index.search(QUERIES, 4)
    assert server.requests_served == 3  # 9 queries in parts of 3
    assert HTTPSearcher(server.url).fingerprint == index.fingerprint


def test_closed_port_raises_tool_unavailable_after_the_budget():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    notes: list[str] = []
    searcher = HTTPSearcher(f"http://127.0.0.1:{port}", "0" * 32, retry_seconds=0.3, note=notes.append)
    t0 = time.monotonic()
    with pytest.raises(ToolUnavailable, match="unreachable"):
        searcher.search(["q"], 3)
    assert 0.3 <= time.monotonic() - t0 < 3
    assert len(notes) == 1 and f"127.0.0.1:{port}" in notes[0] and "retrying for up to 0.3 s" in notes[0]
    with pytest.raises(ToolUnavailable):  # without a fingerprint it asks /health at once
        HTTPSearcher(f"http://127.0.0.1:{port}", retry_seconds=0.1, note=notes.append)


def test_endpoint_coming_up_during_the_budget_is_used(index):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv_box: list = []

    def start_later():
        time.sleep(0.4)
        srv = make_server(index, "127.0.0.1", port)
        srv_box.append(srv)
        srv.serve_forever(0.05)

    threading.Thread(target=start_later, daemon=True).start()
    try:
        found = HTTPSearcher(f"http://127.0.0.1:{port}", retry_seconds=10, note=lambda m: None).search(["zq3x"], 1)
        assert found[0][0].id == "d3"
    finally:
        while not srv_box:
            time.sleep(0.05)
        srv_box[0].shutdown()
        srv_box[0].server_close()


def test_fingerprint_mismatch_is_a_clear_error_not_a_retry(server):
    searcher = HTTPSearcher(server.url, fingerprint="0" * 32, retry_seconds=30)
    t0 = time.monotonic()
    with pytest.raises(RetrieverMismatch) as e:
        searcher.search(["q"], 1)
    with pytest.raises(RetrieverMismatch):
        searcher.health()
    assert isinstance(e.value, ContractMismatch) and e.value.fields == ["retriever.fingerprint"]
    assert "0" * 32 in str(e.value) and time.monotonic() - t0 < 5


def test_refused_request_is_not_retried(server):
    with pytest.raises(RetrieverError, match="HTTP 400 k: must be"):
        HTTPSearcher(server.url, retry_seconds=30).search(["q"], 99)


def test_parse_limits_query_length():
    with pytest.raises(ValueError, match="longer than 4"):
        parse_search_request(b'{"queries": ["abcde"]}', RequestLimits(max_query_chars=4))
    assert parse_search_request(b'{"queries": []}', RequestLimits()).k == 3
