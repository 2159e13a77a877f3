"""Metrics chunks are untrusted: every reader (``read_bucket_metrics``, ``stoa plot``'s rows, ``stoa eval``'s done
versions, a local metrics file) skips a hostile line or chunk, counts it, warns once per chunk and reads the rest."""

from __future__ import annotations

import logging

import pytest

from stoa.bucket import open_bucket
from stoa.evaluator.loop import _due, evaluated_versions
from stoa.layout import metrics_chunk_key
from stoa.observe import plotdata
from stoa.telemetry.metrics import (
    MAX_LINE_BYTES,
    BucketMetrics,
    ReadCounts,
    read_bucket_metrics,
    read_chunk,
    read_metrics,
    read_sourced_chunks,
)

HOSTILE_LINES = {
    "deep": b"[" * 100_000,
    "deep object": b'{"a": ' * 100_000,
    "long integer": b'{"version": 3, "train/loss": ' + b"1" * 5001 + b"}",
    "NaN": b'{"version": 3, "train/loss": NaN}',
    "Infinity": b'{"version": 3, "train/loss": -Infinity}',
    "overflowing float": b'{"version": 3, "train/loss": 1e999}',
    "list, not an object": b"[1, 2, 3]",
    "string, not an object": b'"row"',
    "invalid UTF-8": b'{"version": 3, "note": "\xff\xfe"}',
    "not JSON": b"{version: 3",
    "too long": b'{"pad": "' + b"x" * MAX_LINE_BYTES + b'"}',
}
"""One line of each kind a hostile bucket writer could put in a metrics chunk."""


def honest(i: int) -> bytes:
    return b'{"version": %d, "eval/accuracy": 0.5, "i": %d}' % (i, i)


def plant(bucket, source: str, start: int, lines: list[bytes]) -> str:
    key = metrics_chunk_key("r", source, start, 0)
    bucket.put(key, b"\n".join(lines) + b"\n")
    return key


@pytest.mark.parametrize("kind", sorted(HOSTILE_LINES))
def test_each_hostile_line_is_skipped_counted_and_the_rest_of_the_chunk_and_run_still_read(tmp_path, kind, caplog):
    bucket = open_bucket(str(tmp_path / "b"))
    key = plant(bucket, "eval", 1_700_000_000, [honest(1), HOSTILE_LINES[kind], honest(2)])
    plant(bucket, "eval", 1_700_000_001, [honest(3)])
    counts = ReadCounts()
    with caplog.at_level(logging.WARNING, logger="stoa.telemetry.metrics"):
        rows = read_bucket_metrics(bucket, "r", source="eval", counts=counts)
    assert [r["i"] for r in rows] == [1, 2, 3]
    assert (counts.chunks, counts.bad_chunks, counts.bad_lines) == (2, 0, 1)
    assert [r.getMessage() for r in caplog.records if key in r.getMessage()] != []
    assert len(caplog.records) == 1  # one line for the chunk
    assert evaluated_versions(bucket, "r") == {1, 2, 3}  # stoa eval's start reads on past it
    assert [row["i"] for _, row in plotdata.read_sourced_rows(bucket, "r")] == [1, 2, 3]  # stoa plot too
    local = tmp_path / "eval.jsonl"
    local.write_bytes(b"\n".join([honest(1), HOSTILE_LINES[kind], honest(2)]) + b"\n")
    assert [r["i"] for r in read_metrics(local)] == [1, 2]


def test_a_chunk_of_many_bad_lines_warns_once_and_counts_each(tmp_path, caplog):
    bucket = open_bucket(str(tmp_path / "b"))
    plant(bucket, "trainer", 1_700_000_000, list(HOSTILE_LINES.values()) * 3 + [honest(7)])
    counts = ReadCounts()
    with caplog.at_level(logging.WARNING, logger="stoa.telemetry.metrics"):
        rows = read_bucket_metrics(bucket, "r", counts=counts)
    assert [r["i"] for r in rows] == [7]
    assert counts.bad_lines == 3 * len(HOSTILE_LINES)
    assert len(caplog.records) == 1


def test_an_oversized_chunk_is_skipped_unread_and_the_others_read(tmp_path, monkeypatch, caplog):
    bucket = open_bucket(str(tmp_path / "b"))
    plant(bucket, "trainer", 1_700_000_000, [honest(1)])
    big = plant(bucket, "trainer", 1_700_000_001, [honest(2)] * 100)
    plant(bucket, "trainer", 1_700_000_002, [honest(3)])
    cap = len(bucket.get(big)) - 1
    fetched = []
    real = bucket.get_range
    monkeypatch.setattr(bucket, "get_range", lambda k, a, b: fetched.append((k, b - a)) or real(k, a, b))
    counts = ReadCounts()
    with caplog.at_level(logging.WARNING, logger="stoa.telemetry.metrics"):
        rows = read_sourced_chunks(bucket, "r", max_chunk_bytes=cap, counts=counts)
    assert [row["i"] for _, row in rows] == [1, 3]
    assert (counts.chunks, counts.bad_chunks) == (2, 1)
    assert big not in [k for k, _ in fetched] and all(n == cap + 1 for _, n in fetched)
    assert len(caplog.records) == 1
    assert read_chunk(bucket, big, cap) is None  # listed smaller than it is: read at most cap + 1 bytes, refused


def test_a_chunk_deleted_after_the_listing_is_skipped(tmp_path):
    bucket = open_bucket(str(tmp_path / "b"))
    plant(bucket, "trainer", 1_700_000_000, [honest(1)])
    got = read_chunk(bucket, metrics_chunk_key("r", "trainer", 1_700_000_009, 0))
    assert got is not None and (got.rows, got.bad) == ([], 0)


def test_a_local_file_with_an_overlong_line_reads_the_rows_around_it(tmp_path, monkeypatch):
    import stoa.telemetry.metrics as metrics

    monkeypatch.setattr(metrics, "MAX_LINE_BYTES", 64)
    path = tmp_path / "m.jsonl"
    path.write_bytes(honest(1) + b"\n" + b'{"pad": "' + b"y" * 1000 + b'"}\n' + honest(2) + b"\n" + b'{"torn')
    assert [r["i"] for r in read_metrics(path)] == [1, 2]


def test_the_writer_round_trips_through_the_bounded_reader(tmp_path):
    bucket = open_bucket(str(tmp_path / "b"))
    sink = BucketMetrics(bucket, "r", flush_rows=2)
    keys = [f"v{i:08d}/w-{i:08d}.rec" for i in range(500)]
    for i in range(3):
        sink.add({"time": 1.7e9, "step": i, "train/loss": 0.1 * i, "rollout/keys": keys, "worker/engine": "torch"})
    sink.flush()
    counts = ReadCounts()
    rows = read_bucket_metrics(bucket, "r", counts=counts)
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[0]["rollout/keys"] == keys and counts.bad_lines == 0


class _Ev:
    """Just what ``_due`` reads of an evaluator."""

    def __init__(self, done: set[int], follow: bool = True, backfill: bool = False) -> None:
        from types import SimpleNamespace

        self.cfg = SimpleNamespace(follow=follow, backfill=backfill, every=1, max_versions=0)
        self.done, self.lo = done, None
        self.summary = SimpleNamespace(evaluated=[])


def test_forged_eval_versions_neither_stop_the_evaluator_nor_make_it_count_to_them(tmp_path):
    from types import SimpleNamespace

    bucket = open_bucket(str(tmp_path / "b"))
    plant(bucket, "eval", 1_700_000_000, [honest(2), honest(-10**30), honest(10**30), honest(2**60),
                                          b'{"version": true, "eval/accuracy": 1}', honest(99)])
    done = evaluated_versions(bucket, "r")
    assert done == {2, 99}  # negative and huge versions are not versions
    due = _due(_Ev(done), SimpleNamespace(version=6), final=False)  # type: ignore[arg-type]
    assert due == [3, 4, 5, 6]  # v99 lies past the pointer: it moves nothing
