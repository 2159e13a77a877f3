"""Metrics in the bucket: create-only chunks read back in order; a failing upload keeps its rows."""

from __future__ import annotations

from stoa.bucket import BucketUnreachable, open_bucket
from stoa.layout import metrics_chunk_key
from stoa.telemetry.metrics import BucketMetrics, MetricsWriter, read_bucket_metrics, read_metrics


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_chunks_round_trip_in_order_and_the_local_file_keeps_every_row(tmp_path):
    bucket = open_bucket(str(tmp_path / "b"))
    mono = Clock(0.0)
    sink = BucketMetrics(bucket, "r", flush_rows=3, flush_seconds=10, clock=Clock(1_700_000_000), mono=mono)
    w = MetricsWriter(tmp_path / "trainer.jsonl", sink=sink)
    for i in range(4):
        w.log({"i": i})
    mono.t = 11.0
    w.log({"i": 4})  # the oldest buffered row is 11 s old: flushed with 2 rows
    w.log({"i": 5})
    w.close()  # the last row
    assert sink.uploads == 3
    assert bucket.exists(metrics_chunk_key("r", "trainer", 1_700_000_000, 2))
    later = BucketMetrics(bucket, "r", flush_rows=1, clock=Clock(1_700_000_100))  # a restarted trainer
    later.add({"i": 6})
    BucketMetrics(bucket, "r", "w-1", flush_rows=1).add({"other": 1})
    assert [r["i"] for r in read_bucket_metrics(bucket, "r")] == list(range(7))
    assert [r["i"] for r in read_metrics(tmp_path / "trainer.jsonl")] == list(range(6))
    assert len(read_bucket_metrics(bucket, "r", source=None)) == 8


def test_a_failing_upload_keeps_its_rows_for_the_next_flush(tmp_path):
    inner = open_bucket(str(tmp_path / "b"))

    class Flaky:
        down = True

        def __getattr__(self, name):
            return getattr(inner, name)

        def put_create(self, key, data):
            if self.down:
                raise BucketUnreachable("injected")
            return inner.put_create(key, data)

    flaky = Flaky()
    sink = BucketMetrics(flaky, "r", flush_rows=2)
    for i in range(3):
        sink.add({"i": i})  # no raise
    assert sink.failures == 2 and len(sink.rows) == 3
    flaky.down = False
    assert sink.flush() and sink.rows == []
    assert [r["i"] for r in read_bucket_metrics(inner, "r")] == [0, 1, 2]
