"""The evaluator's heartbeat, ``runs/<run>/evaluator.json``: tells a trainer that a follow-along evaluator is
present (so it can skip its own periodic evaluations). Stdlib and the bucket layer only."""

from __future__ import annotations

import json
import math
import os
import socket
import time
from dataclasses import asdict, dataclass

from stoa.bucket import Bucket, ObjectNotFound
from stoa.layout import evaluator_key

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
        """Parse strictly; None for anything malformed (the object is untrusted).

        Args:
            data: the stored bytes.
        """
        if len(data) > MAX_HEARTBEAT_BYTES:
            return None
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None
        if not isinstance(d, dict) or type(d.get("time")) not in (int, float) or not math.isfinite(d["time"]):
            return None
        version, stopped = d.get("version"), d.get("stopped", False)
        if not isinstance(d.get("host"), str) or type(d.get("pid")) is not int or type(stopped) is not bool:
            return None
        if version is not None and type(version) is not int:
            return None
        return cls(float(d["time"]), d["host"], d["pid"], version, stopped)


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
