"""What the run's processes announce in the bucket, and for how long it counts.

- ``runs/<run>/status.json``: what the trainer tells its workers (state, heartbeat, wanted groups, the workers
  it counts); workers pace themselves by it (``stoa.worker.pacing``), ``stoa status`` shows it.
- ``runs/<run>/workers/<id>-<seq>``: a worker's presence object (empty, create-only); the trainer counts the
  ids it lists for ``LIVE_S`` seconds (``stoa.trainer.liveness``).
- ``runs/<run>/evaluator.json``: a follow-along evaluator's heartbeat; while it beats, the trainer leaves its
  periodic evaluations to it.

Anyone who can write the bucket can write these objects: they only steer pausing and evaluation, never what
is trained. What they hold is typed in ``stoa.schemas.control``. Stdlib and the bucket layer only.
"""

from __future__ import annotations

import os
import socket
import time

from stoa.bucket import Bucket, ObjectNotFound
from stoa.layout import evaluator_key, status_key
from stoa.schemas.control import EvaluatorHeartbeat, RunStatus

PRESENCE_S = 60.0
"""A worker that uploaded nothing for this long writes a presence object again."""
LIVE_S = 3 * PRESENCE_S
"""The trainer counts a worker live this long after its last accepted record or presence object."""


def read_status(bucket: Bucket, run_id: str) -> RunStatus | None:
    """The run's status, or ``None`` when absent or malformed (bucket errors propagate).

    Args:
        bucket: the run's bucket.
        run_id: the run id.
    """
    try:
        data = bucket.get(status_key(run_id))
    except ObjectNotFound:
        return None
    try:
        return RunStatus.parse(data, status_key(run_id))
    except ValueError:
        return None


def write_heartbeat(bucket: Bucket, run_id: str, version: int | None, *, stopped: bool = False) -> EvaluatorHeartbeat:
    """Create or overwrite the run's evaluator heartbeat with this process's time, host and pid.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        version: the newest version evaluated so far (None before the first).
        stopped: mark the evaluator as gone (written once at exit).
    """
    beat = EvaluatorHeartbeat(time.time(), socket.gethostname(), os.getpid(), version, stopped)
    bucket.put(evaluator_key(run_id), beat.to_json())
    return beat


def read_heartbeat(bucket: Bucket, run_id: str) -> EvaluatorHeartbeat | None:
    """The run's evaluator heartbeat; None when absent or malformed (bucket errors propagate).

    Args:
        bucket: the run's bucket.
        run_id: the run.
    """
    try:
        data = bucket.get(evaluator_key(run_id))
    except ObjectNotFound:
        return None
    try:
        return EvaluatorHeartbeat.parse(data, evaluator_key(run_id))
    except ValueError:  # refused: a trainer then runs its own evaluations, as without an evaluator
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


def age(seconds: float | None) -> str:
    """A duration as ``12s``, ``4m05s``, ``3h20m`` or ``2d03h`` (``?`` when unknown; negative: clock skew).

    Args:
        seconds: the duration.
    """
    if seconds is None:
        return "?"
    sign, s = ("-" if seconds < 0 else ""), int(abs(seconds))
    if s < 60:
        return f"{sign}{s}s"
    if s < 3600:
        return f"{sign}{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{sign}{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{sign}{s // 86400}d{s % 86400 // 3600:02d}h"
