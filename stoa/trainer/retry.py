"""Riding out bucket outages on the trainer's writes (every rank's)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

from stoa.bucket import BucketError, ObjectExists, PreconditionFailed

_T = TypeVar("_T")
RETRY_MAX_SLEEP_S = 30.0
"""Longest wait between two tries of a bucket write during an outage."""


def ride_out(fn: Callable[[], _T], what: str, echo=print, max_sleep_s: float = RETRY_MAX_SLEEP_S) -> _T:
    """Call ``fn`` until it does not raise a transient ``BucketError`` (jittered exponential backoff).

    The trainer's writes (journal, patch, anchor, pointer, checkpoint) are safe to repeat, so a bucket
    outage delays the run instead of stopping it. Conflicts (``PreconditionFailed``, ``ObjectExists``)
    are not outages and propagate.

    Args:
        fn: the write.
        what: what it writes, for the log line.
        echo: where the waiting note goes.
        max_sleep_s: cap of the backoff.
    """
    delay = 1.0
    while True:
        try:
            return fn()
        except (PreconditionFailed, ObjectExists):
            raise
        except BucketError as e:
            echo(f"[trainer] bucket error while writing {what}, retrying in {delay:.0f}s: {e}")
            time.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(max_sleep_s, delay * 2)
