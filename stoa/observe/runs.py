"""The runs of a bucket, read from the bucket alone (``stoa runs``), and deleting one (``stoa runs rm``).

A listing of ``runs/`` groups every object by its run (one LIST request per 1,000 objects); per run, at most
four small GETs: ``status.json`` (state, heartbeat), the weight pointer (version), the trainer lease (is a
trainer alive?) and ``run.json`` (the model's architecture). Everything read is untrusted: an object larger
than :data:`MAX_SMALL_BYTES` is never fetched, anything unreadable shows as ``?``, and a key under ``runs/``
that names no run (``runs/x``, ``runs//y``) is only counted.

A trainer's lease is *live* when it is not released and its heartbeat is younger than
:data:`~stoa.trainer.lease.DEFAULT_TTL_S` (a running trainer renews it every few seconds); such a run is
never deleted.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from stoa.bucket import Bucket, BucketError, ObjectInfo
from stoa.config.base import ConfigError
from stoa.contract import RunNotFound
from stoa.layout import RUNS_ROOT, contract_key, lease_key, parse_run_key, pointer_key, run_prefix, status_key
from stoa.lifecycle import age
from stoa.observe.status import size
from stoa.schemas.control import LeaseRecord, RunStatus
from stoa.trainer.lease import DEFAULT_TTL_S, LeaseHeld
from stoa.untrusted import loads_bounded
from stoa.weights.errors import WeightsError
from stoa.weights.pointer import Pointer

MAX_SMALL_BYTES = 1 << 16
"""Status, pointer, lease and run.json larger than this are not fetched (they read as ``?``)."""
UNKNOWN = "?"
"""What a column shows when its object is absent, too large or unreadable."""


@dataclass(frozen=True)
class RunRow:
    """One run of a bucket.

    Args:
        run: the run id as listed (see :func:`printable` before showing it).
        state: ``running``, ``finished`` or ``failed`` from status.json; ``stale`` when it says running but
            no live trainer holds the run; ``?`` when unreadable or absent.
        version: the weight pointer's version (None: unreadable or none published).
        age_s: seconds since the trainer last wrote status.json (None: unreadable).
        objects: objects under ``runs/<run>/``.
        nbytes: their total size.
        live: a live trainer lease holds the run.
        model: the model architecture from run.json (``?``: unreadable).
    """

    run: str
    state: str
    version: int | None
    age_s: float | None
    objects: int
    nbytes: int
    live: bool
    model: str


@dataclass(frozen=True)
class RunListing:
    """Every run of a bucket and the objects under ``runs/`` that belong to none.

    Args:
        runs: one row per run, by run id.
        stray: objects whose key under ``runs/`` names no run.
    """

    runs: list[RunRow]
    stray: int


def _small(bucket: Bucket, key: str, listed: dict[str, int]) -> bytes | None:
    """A listed object no larger than :data:`MAX_SMALL_BYTES` (None: not listed, too big or gone since)."""
    if listed.get(key, MAX_SMALL_BYTES + 1) > MAX_SMALL_BYTES:
        return None
    try:
        return bucket.get(key)
    except (BucketError, ValueError):  # gone since the listing, or a listed key the bucket API refuses
        return None


def _json_obj(data: bytes | None) -> dict[str, Any] | None:
    """Bounded parse of a small object; None unless it is a JSON object."""
    try:
        value = loads_bounded(data, max_bytes=MAX_SMALL_BYTES) if data is not None else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def lease_live(data: bytes | None, now: float) -> bool:
    """Whether lease bytes name a trainer that still holds the run (not released, heartbeat younger than
    the TTL; a heartbeat in the future, clock skew, counts as live).

    Args:
        data: the bytes of ``lease.json`` (None: absent); parsed like the trainer parses it.
        now: the wall clock.
    """

    rec = LeaseRecord.from_json(data) if data is not None else None  # total: None for anything malformed
    return rec is not None and not rec.released and now - rec.heartbeat < DEFAULT_TTL_S


def _version(data: bytes | None) -> int | None:

    if data is None:
        return None
    try:
        return Pointer.from_json(data).version
    except WeightsError:
        return None


def _model(data: bytes | None) -> str:
    model = (_json_obj(data) or {}).get("model")
    arch = model.get("architecture") if isinstance(model, dict) else None
    return arch[:40] if isinstance(arch, str) and arch else UNKNOWN


def run_row(bucket: Bucket, run_id: str, objects: list[ObjectInfo], now: float) -> RunRow:
    """The row of one run from its listed objects and its small objects.

    Args:
        bucket: the bucket.
        run_id: the run.
        objects: every object under ``runs/<run>/``.
        now: the wall clock.
    """
    listed = {o.key: o.size for o in objects}
    raw = _small(bucket, status_key(run_id), listed)
    status = RunStatus.from_json(raw) if raw is not None else None
    live = lease_live(_small(bucket, lease_key(run_id), listed), now)
    state = UNKNOWN if status is None else status.state
    if state == "running" and not live:
        state = "stale"
    return RunRow(run_id, state, _version(_small(bucket, pointer_key(run_id), listed)),
                  None if status is None else now - status.heartbeat_at, len(objects),
                  sum(o.size for o in objects), live, _model(_small(bucket, contract_key(run_id), listed)))


def list_runs(bucket: Bucket, *, now: float | None = None) -> RunListing:
    """Every run of a bucket, by run id.

    Args:
        bucket: the bucket (read only).
        now: the wall clock [default: time.time()].
    """
    now = time.time() if now is None else now
    by_run: dict[str, list[ObjectInfo]] = defaultdict(list)
    stray = 0
    for o in bucket.list(RUNS_ROOT):
        run_id = parse_run_key(o.key)
        if run_id is None:
            stray += 1
        else:
            by_run[run_id].append(o)
    return RunListing([run_row(bucket, r, objs, now) for r, objs in sorted(by_run.items())], stray)


def check_run_id(run_id: str) -> None:
    """Refuse a RUN argument that is not one run's name (empty; holding ``/``, whose prefix would name a part
    of another run; or control characters, which no bucket key holds).

    Args:
        run_id: the RUN argument.

    Raises:
        ConfigError: the id is empty or holds ``/`` or control characters.
    """

    if not run_id or "/" in run_id or not run_id.isprintable():
        raise ConfigError("RUN", f"{run_id!r} is not a run id (empty, or holding '/' or control characters); "
                                 "give one id that stoa runs lists")


def inspect_run(bucket: Bucket, run_id: str, *, now: float | None = None) -> RunRow:
    """The row of one run; refuses a run that does not exist.

    Args:
        bucket: the bucket.
        run_id: the run.
        now: the wall clock [default: time.time()].

    Raises:
        ConfigError: a RUN that is not a run id.
        RunNotFound: nothing is stored under ``runs/<run>/``.
    """
    check_run_id(run_id)
    objects = list(bucket.list(run_prefix(run_id) + "/"))
    if not objects:
        raise RunNotFound(f"no run {run_id!r} in bucket {bucket.url} (nothing under its prefix); stoa runs "
                          f"--bucket {bucket.url} lists the runs")
    return run_row(bucket, run_id, objects, time.time() if now is None else now)


def refuse_live(row: RunRow) -> None:
    """Raise when a live trainer holds the run.

    Args:
        row: the run.

    Raises:
        LeaseHeld: the run's lease is live.
    """

    if row.live:
        raise LeaseHeld(f"a trainer holds run {printable(row.run)} (its lease heartbeat is younger than "
                        f"{DEFAULT_TTL_S:g}s); stop the trainer (Ctrl-C) and run stoa runs rm again")


def delete_run(bucket: Bucket, run_id: str, *, now: float | None = None) -> int:
    """Delete every object of a run (S3: bulk deletes of 1,000 keys); refuses a run a live trainer holds.

    The lease is read again right before deleting. A deletion cut short leaves a run that ``stoa runs``
    still lists and that ``delete_run`` finishes.

    Args:
        bucket: the bucket.
        run_id: the run.
        now: the wall clock [default: time.time()].

    Returns:
        the number of objects deleted.

    Raises:
        ConfigError: a RUN that is not a run id.
        RunNotFound: nothing is stored under ``runs/<run>/``.
        LeaseHeld: a live trainer holds the run.
        BucketError: a key under the run that the bucket API refuses (written by another tool).
    """
    refuse_live(inspect_run(bucket, run_id, now=now))
    try:
        return bucket.delete_prefix(run_prefix(run_id) + "/")
    except ValueError as e:  # a key written by another tool that the bucket API refuses (control characters)
        raise BucketError(f"run {printable(run_id)}: {e}; delete what stoa runs still lists of it with the "
                          "store's own tools") from None


def printable(text: str) -> str:
    """A run id safe to print: as is when printable, else its ``ascii()`` (control characters escaped).

    Args:
        text: an id read from a listing.
    """
    return text if text.isprintable() and text.strip() == text and text else ascii(text)


def render(listing: RunListing) -> str:
    """The table ``stoa runs`` prints.

    Args:
        listing: the runs.
    """

    head = ("RUN", "STATE", "VERSION", "AGE", "SIZE", "OBJECTS", "MODEL")
    rows = [(printable(r.run)[:64], r.state, UNKNOWN if r.version is None else str(r.version), age(r.age_s),
             size(r.nbytes), str(r.objects), r.model) for r in listing.runs]
    widths = [max(len(c) for c in col) for col in zip(head, *rows, strict=True)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [head, *rows]]
    if not listing.runs:
        lines = ["no runs in this bucket"]
    if listing.stray:
        lines.append(f"{listing.stray} objects under runs/ belong to no run (their keys name none)")
    return "\n".join(lines)
