"""The evaluator's heartbeat, ``runs/<run>/evaluator.json``: tells a trainer that a follow-along evaluator is
present (so it can skip its own periodic evaluations). Stdlib, numpy (``stoa.untrusted``) and the bucket layer only."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass

from stoa.bucket import Bucket, ObjectNotFound
from stoa.layout import evaluator_key
from stoa.untrusted import check_int, check_number, field_bool, field_int, field_text, load_object

MAX_HEARTBEAT_BYTES = 4096
"""A heartbeat object larger than this is ignored (anyone who can write the bucket can write it)."""


@dataclass(frozen=True)
class Heartbeat:
    """What ``evaluator.json`` holds.

    Args:
        time: unix time of this write (the evaluator's clock).
        host: the evaluator's host name.
        pid: its process id.
        version: the newest version it evaluated (None before the first).
        stopped: True once the evaluator exited (then it is not present, whatever the time).
    """

    time: float
    host: str
    pid: int
    version: int | None = None
    stopped: bool = False

    def to_json(self) -> bytes:
        """Serialize for the bucket."""
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Heartbeat | None:
        """Parse strictly (``stoa.untrusted``: at most 4 KiB, one object deep, exact types); None for anything
        malformed (the object is untrusted): a trainer then runs its own evaluations, as without an evaluator.

        Args:
            data: the stored bytes.
        """
        try:
            d = load_object(data, "evaluator.json", max_bytes=MAX_HEARTBEAT_BYTES, max_depth=1)
            version = d.get("version")
            return cls(check_number(d.get("time"), "time"), field_text(d, "host", max_len=256),
                       field_int(d, "pid", lo=-(1 << 31), hi=(1 << 31) - 1),
                       None if version is None else check_int(version, "version"),
                       field_bool(d, "stopped", default=False))
        except ValueError:
            return None


def write_heartbeat(bucket: Bucket, run_id: str, version: int | None, *, stopped: bool = False) -> Heartbeat:
    """Create or overwrite the run's evaluator heartbeat with this process's time, host and pid.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        version: the newest version evaluated so far (None before the first).
        stopped: mark the evaluator as gone (written once at exit).
    """
    beat = Heartbeat(time.time(), socket.gethostname(), os.getpid(), version, stopped)
    bucket.put(evaluator_key(run_id), beat.to_json())
    return beat


def read_heartbeat(bucket: Bucket, run_id: str) -> Heartbeat | None:
    """The run's evaluator heartbeat; None when absent or malformed (bucket errors propagate).

    Args:
        bucket: the run's bucket.
        run_id: the run.
    """
    try:
        return Heartbeat.from_json(bucket.get(evaluator_key(run_id)))
    except ObjectNotFound:
        return None


def evaluator_present(bucket: Bucket, run_id: str, max_age_s: float, *, now: float | None = None) -> bool:
    """Whether a follow-along evaluator is running on the run: a heartbeat at most ``max_age_s`` old and not
    marked stopped. The age is measured against this machine's clock, so allow for clock skew in
    ``max_age_s`` (the evaluator beats every ``heartbeat_seconds``, 30 s by default).

    Args:
        bucket: the run's bucket.
        run_id: the run.
        max_age_s: the oldest heartbeat that still counts.
        now: the current unix time (default: ``time.time()``).
    """
    beat = read_heartbeat(bucket, run_id)
    if beat is None or beat.stopped:
        return False
    return (time.time() if now is None else now) - beat.time <= max_age_s
