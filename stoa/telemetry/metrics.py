"""Metrics as JSONL lines (``train/*``, ``rollout/*``, ``worker/*``, ``eval/*``), bucket chunks and trackers.

Every chunk read back is untrusted (any bucket writer can forge one): each line goes through the bounded parser
of ``stoa.untrusted`` (size, depth, number literals; NaN and Infinity refused), a line that is not an object is
skipped and counted, a chunk over :data:`MAX_CHUNK_BYTES` is never read past that, and each chunk with something
skipped logs one warning line.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from stoa.bucket import BucketError, ObjectExists, ObjectNotFound
from stoa.layout import metrics_chunk_key, metrics_prefix, parse_metrics_chunk_key
from stoa.schemas.rows import MAX_ROW_BYTES, MetricsRow
from stoa.telemetry.trackers import TrackerSet

if TYPE_CHECKING:
    from stoa.telemetry.trackers import Completion, Tracker

log = logging.getLogger(__name__)


class MetricsWriter:
    """Append one JSON object per ``log`` call to ``path``; also hand each row to the bucket and the trackers.

    Args:
        path: the JSONL file (parent directories are created).
        run_name: a label for this writer (the run or worker id).
        sink: also hand every row to this :class:`BucketMetrics` (chunks in the bucket).
        trackers: experiment trackers (``stoa.telemetry.trackers.open_trackers``: W&B, TensorBoard); one that raises is
            disabled with one warning and the JSONL file keeps every row.
    """

    def __init__(self, path: str | Path, run_name: str = "stoa", sink: BucketMetrics | None = None,
                 trackers: Iterable[Tracker] = ()):

        self.path, self.run_name = Path(path), run_name
        self.sink = sink
        self.trackers = TrackerSet(trackers)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Write one line; non-finite floats become null.

        Args:
            metrics: flat name -> number/str.
            step: optional step counter stored as ``step``.
        """
        row: dict[str, Any] = {"time": round(time.time(), 3)}
        if step is not None:
            row["step"] = step
        for k, v in metrics.items():
            if isinstance(v, float) and not math.isfinite(v):
                v = None
            row[k] = v
        self._fh.write(MetricsRow(row).dumps())
        if self.sink is not None:
            self.sink.add(row)
        self.trackers.log({k: v for k, v in row.items() if k not in ("time", "step")}, step)

    def completions_due(self, step: int) -> bool:
        """Whether a tracker wants a completions table at ``step`` (``STOA_WANDB_COMPLETIONS_EVERY``)."""
        return self.trackers.completions_due(step)

    def log_completions(self, rows: Sequence[Completion], step: int | None = None) -> None:
        """Hand a few sampled completions (prompt id, text, reward) to the trackers that keep a table.

        Args:
            rows: the completions (``stoa.telemetry.trackers.sample_completions``).
            step: the trainer step.
        """
        self.trackers.log_completions(rows, step)

    def close(self, upload: bool = True) -> None:
        """Flush and close.

        Args:
            upload: flush the rows still buffered for the bucket (False: keep them only in the local file,
                e.g. when this trainer may no longer write to the bucket).
        """
        try:
            if self.sink is not None and upload:
                self.sink.flush()
        finally:
            self._fh.close()
            self.trackers.close()


class BucketMetrics:
    """Rows uploaded as create-only chunk objects ``runs/<run>/metrics/<source>-<start>-<seq>.jsonl``.

    S3 has no append, so rows are buffered and flushed as a new object every ``flush_rows`` rows or
    ``flush_seconds`` seconds (checked on each row) and at close. An upload that fails is logged and
    its rows stay buffered for the next flush: metrics never stop training.

    Args:
        bucket: the run's bucket.
        run_id: the run id.
        source: who writes (``trainer``); part of the key.
        flush_rows: flush once this many rows are buffered.
        flush_seconds: flush once the oldest buffered row is this old.
        fence: called before every upload; raises when this process may no longer write.
        clock: wall clock (the chunk names' start) and monotonic clock for the interval.
        mono: monotonic clock.
    """

    def __init__(self, bucket: Any, run_id: str, source: str = "trainer", *, flush_rows: int = 20,
                 flush_seconds: float = 60.0, fence: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic) -> None:
        self.bucket, self.run_id, self.source = bucket, run_id, source
        self.flush_rows, self.flush_seconds, self.fence = flush_rows, flush_seconds, fence
        self.start, self._mono = int(clock()), mono
        self.seq = 0
        self.rows: list[dict[str, Any]] = []
        self._first_at = 0.0
        self.uploads = self.failures = 0

    def add(self, row: dict[str, Any]) -> None:
        """Buffer one row; flush when enough rows or seconds have gathered.

        Args:
            row: a metrics row (JSON-able).
        """
        if not self.rows:
            self._first_at = self._mono()
        self.rows.append(row)
        if len(self.rows) >= self.flush_rows or self._mono() - self._first_at >= self.flush_seconds:
            self.flush()

    def flush(self) -> bool:
        """Upload the buffered rows as the next chunk; return whether they landed (or there were none)."""

        if not self.rows:
            return True
        if self.fence is not None:
            self.fence()
        data = "".join(MetricsRow(r).dumps() for r in self.rows).encode()
        for _ in range(3):
            key = metrics_chunk_key(self.run_id, self.source, self.start, self.seq)
            try:
                self.bucket.put_create(key, data)
            except ObjectExists:
                self.seq += 1  # another process of the same source started the same second
                continue
            except BucketError as e:
                self.failures += 1
                log.warning("uploading metrics chunk %s failed, keeping %d rows for the next flush: %s",
                            key, len(self.rows), e)
                return False
            self.seq, self.rows = self.seq + 1, []
            self.uploads += 1
            return True
        return False


MAX_LINE_BYTES = MAX_ROW_BYTES
"""Longest line :func:`read_metrics` reads from a file (a longer one is dropped whole, the rows around it kept)."""
MAX_CHUNK_BYTES = 64 << 20
"""A metrics chunk larger than this is skipped unread (the trainer's are a few kB)."""


class ChunkLines(NamedTuple):
    """The rows of one metrics chunk (or file) and the lines skipped.

    Args:
        rows: every line that is a bounded JSON object, in order.
        bad: lines skipped (not JSON, invalid UTF-8, too long, too deep, a number too long, not an object).
        first_error: why the first skipped line was skipped (empty when none was).
    """

    rows: list[dict[str, Any]]
    bad: int
    first_error: str


@dataclass
class ReadCounts:
    """What a read of a run's metrics chunks skipped (forged or damaged chunks are skipped, never fatal)."""

    chunks: int = 0
    """Chunks read."""
    bad_chunks: int = 0
    """Chunks skipped whole (larger than the cap)."""
    bad_lines: int = 0
    """Lines skipped inside the chunks read."""


def parse_metrics_line(line: bytes) -> dict[str, Any]:
    """One metrics row from untrusted bytes (:meth:`MetricsRow.parse <stoa.schemas.rows.MetricsRow.parse>`).

    Args:
        line: one line of a chunk or a metrics file.

    Raises:
        BadSchemaObject: not a bounded JSON object (the message says why).
    """
    return MetricsRow.parse(line).values


def parse_metrics_lines(lines: Iterable[bytes]) -> ChunkLines:
    """The rows of untrusted lines; a line that is not a row is counted and skipped (blank lines are ignored).

    Args:
        lines: the lines (``data.split(b"\\n")`` of a chunk).
    """
    rows: list[dict[str, Any]] = []
    bad, first = 0, ""
    for line in lines:
        if not line.strip():
            continue
        try:
            rows.append(parse_metrics_line(line))
        except ValueError as e:
            bad, first = bad + 1, first or str(e)[:200]
    return ChunkLines(rows, bad, first)


def read_chunk(bucket: Any, key: str, max_bytes: int = MAX_CHUNK_BYTES) -> ChunkLines | None:
    """The rows of one metrics chunk, reading at most ``max_bytes + 1`` bytes; None when it is larger or gone.

    Args:
        bucket: the run's bucket.
        key: the chunk's key.
        max_bytes: largest chunk read.
    """

    try:
        data = bucket.get_range(key, 0, max_bytes + 1)
    except ObjectNotFound:  # deleted since the listing
        return ChunkLines([], 0, "")
    return parse_metrics_lines(data.split(b"\n")) if len(data) <= max_bytes else None


def read_sourced_chunks(bucket: Any, run_id: str, source: str | None = None, *,
                        max_chunk_bytes: int = MAX_CHUNK_BYTES,
                        counts: ReadCounts | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Every row of a run's metrics chunks with the writer (``source``) of its chunk.

    Chunks are read in writer, process start, chunk order. Every chunk is untrusted: one larger than
    ``max_chunk_bytes`` is skipped unread, a line that is not a bounded JSON object is skipped, and each
    chunk with something skipped logs one warning line (never one per line).

    Args:
        bucket: the run's bucket.
        run_id: the run id.
        source: only chunks of this writer (None: every writer).
        max_chunk_bytes: largest chunk read.
        counts: where the skipped chunks and lines are added up (optional).
    """

    counts = counts if counts is not None else ReadCounts()
    chunks = []
    for info in bucket.list(metrics_prefix(run_id)):
        parsed = parse_metrics_chunk_key(run_id, info.key)
        if parsed is not None and (source is None or parsed.source == source):
            chunks.append((parsed.source, parsed.start, parsed.seq, info.key, info.size))
    rows: list[tuple[str, dict[str, Any]]] = []
    for writer, _, _, key, size in sorted(chunks):
        got = read_chunk(bucket, key, max_chunk_bytes) if size <= max_chunk_bytes else None
        if got is None:
            counts.bad_chunks += 1
            log.warning("metrics chunk %s: skipped, larger than %d bytes", key, max_chunk_bytes)
            continue
        counts.chunks, counts.bad_lines = counts.chunks + 1, counts.bad_lines + got.bad
        if got.bad:
            log.warning("metrics chunk %s: skipped %d of its lines (first: %s)", key, got.bad, got.first_error)
        rows += [(writer, row) for row in got.rows]
    return rows


def read_bucket_metrics(bucket: Any, run_id: str, source: str | None = "trainer",
                        counts: ReadCounts | None = None) -> list[dict[str, Any]]:
    """Every row of a run's metrics chunks, in order (process start, then chunk number).

    Args:
        bucket: the run's bucket.
        run_id: the run id.
        source: only chunks of this writer (None: every writer, ordered by writer first).
        counts: where skipped chunks and lines are added up (see :func:`read_sourced_chunks`).
    """
    return [row for _, row in read_sourced_chunks(bucket, run_id, source, counts=counts)]


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read every row of a metrics JSONL file, skipping a torn last line and any line that is not a row.

    Args:
        path: the JSONL file.
    """
    p = Path(path)
    if not p.exists():
        return []

    def lines() -> Iterator[bytes]:
        with open(p, "rb") as f:
            while line := f.readline(MAX_LINE_BYTES + 1):
                yield line  # an overlong line comes as its first MAX_LINE_BYTES + 1 bytes: refused as too long
                while len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                    line = f.readline(MAX_LINE_BYTES + 1)  # the rest of it, dropped

    return parse_metrics_lines(lines()).rows


def default_log_dir(bucket_url: str, run_id: str, explicit: str = "") -> Path:
    """Where metrics go: the explicit dir, else inside a local bucket, else ./stoa-logs/<run>.

    Args:
        bucket_url: the bucket URL.
        run_id: the run.
        explicit: a user-given directory (wins when set).
    """
    if explicit:
        return Path(explicit)
    if "://" not in bucket_url or bucket_url.startswith("file://"):
        root = bucket_url[len("file://"):] if bucket_url.startswith("file://") else bucket_url

        return Path(root) / metrics_prefix(run_id)
    return Path("stoa-logs") / run_id
