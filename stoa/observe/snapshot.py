"""A run's state read from its bucket alone, from any machine: :func:`take_snapshot`.

One snapshot costs one listing of ``runs/<run>/`` (one LIST request per 1,000 objects), GETs of the four
small objects that exist among status, pointer, lease and journal, and GETs of metrics chunks: the newest
``max_trainer_chunks`` of the trainer, and per worker seen in the window its first chunk (engine) and its
newest ``WORKER_CHUNKS``. Chunks are create-only, so a :class:`ChunkCache` passed to every redraw of
``--watch`` makes later snapshots fetch only new chunks. Everything read is untrusted: a malformed object
reads as absent, a bad metrics line is skipped and counted (``bad_rows``), an oversized chunk is never
fetched (``bad_chunks``). Stdlib and the bucket layer only (no torch).
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from stoa.bucket import Bucket, BucketError, ObjectInfo
from stoa.contract import RunNotFound
from stoa.layout import (
    journal_key,
    lease_key,
    parse_metrics_chunk_key,
    parse_rollout_key,
    pointer_key,
    run_prefix,
    status_key,
)
from stoa.lifecycle import read_status
from stoa.observe.aggregate import WORKER_SOURCE, WorkerView, eval_points, training_view, worker_views
from stoa.observe.costview import CostView, cost_view
from stoa.schemas.control import LeaseRecord, RunStatus
from stoa.schemas.journal import MAX_JOURNAL_BYTES, Journal
from stoa.schemas.rows import MetricsRow
from stoa.telemetry.cost import Prices
from stoa.weights.errors import SyncError
from stoa.weights.pointer import Pointer

PREFIXES = ("model", "weights", "rollouts", "trainer", "metrics", "retriever", "other")
"""The groups of the bucket-size table (``other``: run.json, status.json, logs, foreign keys)."""
LIST_PAGE = 1000
"""Objects per LIST request on S3 and R2."""
MAX_CHUNK_BYTES = 8 << 20
"""A metrics chunk larger than this is not fetched (counted in ``bad_chunks``)."""
MAX_ROWS_PER_CHUNK = 20_000
MAX_SMALL_BYTES = 1 << 20
"""Status, pointer and lease larger than this read as absent."""



class CountingBucket:
    """A read-only view of a bucket that counts requests: LIST pages (1,000 objects each) and GETs.

    Args:
        inner: the bucket.
    """

    def __init__(self, inner: Bucket) -> None:
        self.inner, self.url = inner, inner.url
        self.list_requests = self.get_requests = self.listed = 0

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` (read whole, counted)."""
        items = list(self.inner.list(prefix, start_after=start_after))
        self.list_requests += max(1, math.ceil(len(items) / LIST_PAGE))
        self.listed += len(items)
        return iter(items)

    def get(self, key: str) -> bytes:
        """The object's bytes (counted)."""
        self.get_requests += 1
        return self.inner.get(key)


@dataclass
class ChunkRows:
    """The parsed rows of one metrics chunk and how many of its lines were skipped."""

    rows: list[dict[str, Any]]
    bad: int = 0


ChunkCache = dict[str, ChunkRows]
"""Metrics chunks already read, by key (chunks are create-only, so an entry never goes stale)."""


@dataclass(frozen=True)
class TrainerView:
    """The trainer lease's holder: ``host``, ``pid``, ``holder`` id, take-over ``epoch``, heartbeat age,
    and whether it ``released`` the run (stopped cleanly)."""

    host: str
    pid: int
    holder: str
    epoch: int
    heartbeat_age_s: float
    released: bool


@dataclass(frozen=True)
class PrefixSize:
    """Objects and bytes under one group of prefixes."""

    objects: int
    bytes: int


@dataclass
class Snapshot:
    """Everything ``stoa status`` shows (``to_json`` is what ``--json`` prints).

    Args:
        run: the run id.
        bucket: the bucket URL.
        taken_at: unix time of the snapshot.
        state: ``running``/``finished``/``failed`` from status.json (``unknown`` when absent or malformed).
        heartbeat_age_s: seconds since the trainer's status heartbeat.
        version: the pointer's version (None: no pointer yet); ``version_age_s`` since it was published.
        step: the run's steps so far (the newer of the trainer's metrics and its status).
        target_steps: the run's total steps from the status (0: unbounded; None: unknown, e.g. an older trainer).
        eta_s: seconds to ``target_steps`` at ``steps_per_min`` (None: not running, unbounded or no rate yet).
    """

    run: str
    bucket: str
    taken_at: float
    state: str = "unknown"
    heartbeat_age_s: float | None = None
    wanted_groups: int | None = None
    version: int | None = None
    version_age_s: float | None = None
    plane: str = ""
    trainer: TrainerView | None = None
    step: int | None = None
    target_steps: int | None = None
    eta_s: float | None = None
    steps_per_min: float | None = None
    records_per_s: float | None = None
    reward: list[float | None] = field(default_factory=list)
    reward_steps: list[int] = field(default_factory=list)
    evals: list[dict[str, float | None]] = field(default_factory=list)
    lag: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    quarantined: int = 0
    workers_minutes: float = 10.0
    workers: list[WorkerView] = field(default_factory=list)
    sizes: dict[str, PrefixSize] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)
    bad_rows: int = 0
    bad_chunks: int = 0
    cost: CostView | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict of every field."""
        return asdict(self)


def _small_json(b: CountingBucket, key: str, listed: dict[str, int], cap: int = MAX_SMALL_BYTES) -> bytes | None:
    """The bytes of a listed object no larger than ``cap`` (None: not listed, too big, or gone since)."""
    if key not in listed or listed[key] > cap:
        return None
    try:
        return b.get(key)
    except BucketError:
        return None


def _pointer_age(data: bytes | None, now: float) -> tuple[int | None, float | None, str]:

    if data is None:
        return None, None, ""
    try:
        p = Pointer.from_json(data)
    except SyncError:
        return None, None, ""
    try:
        age = now - datetime.fromisoformat(p.updated_at).timestamp()
    except (ValueError, OverflowError, OSError):
        age = None
    return p.version, age, p.plane


def _trainer(data: bytes | None, now: float) -> TrainerView | None:
    rec = LeaseRecord.from_json(data) if data is not None else None
    if rec is None or not math.isfinite(rec.heartbeat):
        return None
    return TrainerView(rec.host[:128], rec.pid, rec.holder[:64], rec.epoch, now - rec.heartbeat, rec.released)


def _quarantine_rows(data: bytes | None) -> dict[str, tuple[int, str]]:
    """Per worker id, (records rejected, quarantine reason) from the journal's quarantine state."""
    try:
        journal = Journal.parse(data) if data is not None else None
    except ValueError:
        return {}
    rows = journal.quarantine if journal is not None else {}
    return {wid[:128]: (int(row.rejected), row.reason) for wid, row in rows.items()}


def parse_chunk(data: bytes) -> ChunkRows:
    """The JSON object lines of a chunk; any other line (bad JSON, UTF-8, depth, not an object) is counted.

    Args:
        data: the chunk's bytes (untrusted).
    """
    out = ChunkRows([])
    for i, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        if i >= MAX_ROWS_PER_CHUNK:
            out.bad += 1
            continue
        try:
            out.rows.append(MetricsRow.parse(line).values)
        except ValueError:
            out.bad += 1
    return out


class _Reader:
    """Reads metrics chunks through the counting bucket and the cache; tallies bad rows and chunks."""

    def __init__(self, b: CountingBucket, cache: ChunkCache) -> None:
        self.b, self.cache = b, cache
        self.bad_rows = self.bad_chunks = 0

    def rows(self, key: str, size: int) -> list[dict[str, Any]]:
        got = self.cache.get(key)
        if got is None:
            if size > MAX_CHUNK_BYTES:
                self.bad_chunks += 1
                return []
            try:
                got = parse_chunk(self.b.get(key))
            except BucketError:
                return []
            self.cache[key] = got
        self.bad_rows += got.bad
        return got.rows


@dataclass(frozen=True)
class _Chunk:
    start: int
    seq: int
    key: str
    size: int


def _chunks_by_source(run_id: str, objects: list[ObjectInfo]) -> dict[str, list[_Chunk]]:
    """Metrics chunk keys per writer, oldest first (process start, then number)."""
    out: dict[str, list[_Chunk]] = defaultdict(list)
    for o in objects:
        if (c := parse_metrics_chunk_key(run_id, o.key)) is not None:
            out[c.source].append(_Chunk(c.start, c.seq, o.key, o.size))
    for chunks in out.values():
        chunks.sort(key=lambda c: (c.start, c.seq))
    return out


def prefix_sizes(run_id: str, objects: list[ObjectInfo]) -> dict[str, PrefixSize]:
    """Objects and bytes per group of :data:`PREFIXES` (the first path segment under the run).

    Args:
        run_id: the run id.
        objects: the run's listing.
    """
    head = len(run_prefix(run_id)) + 1
    count: Counter[str] = Counter()
    size: Counter[str] = Counter()
    for o in objects:
        seg = o.key[head:].split("/", 1)[0] if "/" in o.key[head:] else "other"
        group = seg if seg in PREFIXES else "other"
        count[group] += 1
        size[group] += o.size
    return {g: PrefixSize(count[g], size[g]) for g in PREFIXES}


def take_snapshot(bucket: Bucket, run_id: str, *, workers_minutes: float = 10.0, max_trainer_chunks: int = 50,
                  cache: ChunkCache | None = None, now: float | None = None, prices: Prices | None = None) -> Snapshot:
    """Read a run's state from its bucket.

    Args:
        bucket: the run's bucket (read only).
        run_id: the run id.
        workers_minutes: show the workers seen in this many minutes before the snapshot (before the last
            heartbeat of a finished or failed run).
        max_trainer_chunks: read at most the newest this many trainer metrics chunks.
        cache: chunks read by earlier snapshots (filled in; pass the same dict to every redraw).
        now: the wall clock [default: time.time()].
        prices: the bucket's prices for the cost lines [default: ``Prices.from_env()``].

    Raises:
        RunNotFound: nothing is stored under the run's prefix.
    """
    now = time.time() if now is None else now
    b = CountingBucket(bucket)
    objects = list(b.list(run_prefix(run_id) + "/"))
    if not objects:
        raise RunNotFound(f"no run {run_id!r} in bucket {bucket.url} (nothing under its prefix); check --run "
                          f"and --bucket")
    listed = {o.key: o.size for o in objects}
    snap = Snapshot(run_id, bucket.url, now, workers_minutes=workers_minutes, sizes=prefix_sizes(run_id, objects))
    status = _status(b, run_id, listed)
    if status is not None:
        snap.state, snap.heartbeat_age_s, snap.wanted_groups = status.state, now - status.heartbeat_at, \
            status.wanted_groups
    snap.version, snap.version_age_s, snap.plane = _pointer_age(_small_json(b, pointer_key(run_id), listed), now)
    snap.trainer = _trainer(_small_json(b, lease_key(run_id), listed), now)
    reader = _Reader(b, {} if cache is None else cache)
    chunks = _chunks_by_source(run_id, objects)
    trainer_rows = [r for c in chunks.get("trainer", [])[-max_trainer_chunks:] for r in reader.rows(c.key, c.size)]
    training_view(snap, trainer_rows)
    progress_view(snap, status)
    evaluator_rows = [r for c in chunks.get("eval", [])[-max_trainer_chunks:] for r in reader.rows(c.key, c.size)]
    if evaluator_rows:  # an evaluator's figures (stoa eval) join the trainer's, in version order
        snap.evals = sorted(snap.evals + eval_points(evaluator_rows), key=lambda e: e["version"] or 0)
    end = now if status is None or status.state == "running" else min(now, status.heartbeat_at)
    quarantine = _quarantine_rows(_small_json(b, journal_key(run_id), listed, MAX_JOURNAL_BYTES))
    records = [k for o in objects if (k := parse_rollout_key(run_id, o.key)) is not None]
    snap.workers = worker_views(run_id, trainer_rows, records, chunks, reader, quarantine,
                                cutoff=end - 60 * workers_minutes, now=now)
    snap.bad_rows, snap.bad_chunks = reader.bad_rows, reader.bad_chunks
    newest = [reader.cache[cs[-1].key].rows for src, cs in chunks.items()  # read for the workers table already
              if src.startswith(WORKER_SOURCE) and cs[-1].key in reader.cache]
    snap.cost = cost_view(trainer_rows, newest, sum(o.size for o in objects), prices or Prices.from_env())
    snap.requests = {"list": b.list_requests, "get": b.get_requests, "listed_objects": b.listed,
                     "cached_chunks": len(reader.cache)}
    return snap


def progress_view(snap: Snapshot, status: RunStatus | None) -> None:
    """Fill the run's step (the status's when it is ahead of the metrics), its target and the ETA to it.

    Args:
        snap: the snapshot, its training figures filled (``training_view``).
        status: the run's status (None: absent or malformed).
    """
    if status is None:
        return
    if status.step > (snap.step or 0):  # the status is written every version, the metrics every 20 rows or 60 s
        snap.step = status.step
    snap.target_steps = status.target_steps
    if snap.state == "running" and status.target_steps and snap.steps_per_min and snap.step is not None:
        snap.eta_s = 60.0 * max(0, status.target_steps - snap.step) / snap.steps_per_min


def _status(b: CountingBucket, run_id: str, listed: dict[str, int]) -> RunStatus | None:
    """The run's status when listed (``read_status`` through the counting bucket; malformed: None)."""
    if status_key(run_id) not in listed:
        return None
    try:
        return read_status(b, run_id)  # type: ignore[arg-type]  # only get() is used
    except BucketError:
        return None


def dumps(snap: Snapshot) -> str:
    """The snapshot as one line of JSON.

    Args:
        snap: the snapshot.
    """
    return json.dumps(snap.to_json(), sort_keys=True)


