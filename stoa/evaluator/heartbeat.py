"""The evaluator's heartbeat, ``runs/<run>/evaluator.json``: tells a trainer that a follow-along evaluator is
present (so it can skip its own periodic evaluations). Stdlib, numpy (``stoa.untrusted``) and the bucket layer only."""

from __future__ import annotations

import os
import socket
import time

from stoa.bucket import Bucket, ObjectNotFound
from stoa.layout import evaluator_key
from stoa.schemas.control import EvaluatorHeartbeat


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
