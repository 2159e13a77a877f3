"""The run's status object, ``runs/<run>/status.json``: what the trainer tells its workers.

The trainer overwrites it at start, once per published version (after the pool listing that follows the
publish, so the want is fresh), every ``status_seconds`` while it waits for records (its heartbeat), and at
exit (``finished`` or ``failed``). Workers read it with a conditional GET next to their pointer poll and
decide, in :meth:`RunWatch.check`, whether to sample, pause or exit:

- ``finished``: exit 0 (the trainer took its steps or stopped cleanly);
- the heartbeat has not moved for ``stale_s`` (or three of the trainer's last step times, if longer),
  or the trainer ``failed``: pause until it moves again (a restarted trainer writes ``running``);
- ``wanted_groups <= 0``: pause (backpressure: the pool already holds what the trainer can use before it
  goes stale, groups it skipped for equal rewards included); while it is positive a worker samples at most
  that many groups per status object it read (:meth:`RunWatch.spend`), then pauses until the trainer writes
  the next one (a new version, its heartbeat, or the want leaving zero). Several workers read the same want
  and may all sample for it, so each status can bring up to the workers' count times the want: bounded
  over-production, never starvation.

When in doubt it samples: a missing, unreadable or malformed status means "sample". Staleness is measured
on the worker's own monotonic clock (time since the heartbeat value last changed), so clock skew between
machines does not matter. Anyone who can write the bucket can write this object: it only steers pausing,
and a forged ``finished`` stops workers, not the trainer. Stdlib and the bucket layer only.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from stoa.bucket import Bucket, BucketError, ObjectNotFound
from stoa.layout import status_key

STATES = ("running", "finished", "failed")
MAX_STATUS_BYTES = 4096
"""A status object larger than this is ignored (treated as absent)."""


@dataclass(frozen=True)
class RunStatus:
    """What ``status.json`` holds.

    Args:
        state: ``running``, ``finished`` or ``failed``.
        version: the newest version the trainer published.
        updated_at: unix time of this write.
        heartbeat_at: unix time the trainer last showed it was alive (equal to ``updated_at`` here).
        wanted_groups: groups the trainer can still use from the current window (None: no backpressure).
        step_s: the trainer's last step time in seconds (workers wait at least 3x this before calling the
            heartbeat stale).
        rollouts_kept_from: the oldest rollout version retention has not deleted (a restart starts there).
        step: the run's optimizer steps so far (restarts included).
        target_steps: the run's total steps (0: unbounded; None: not said, a trainer older than this field);
            ``stoa status`` shows it with an ETA.
    """

    state: str
    version: int
    updated_at: float
    heartbeat_at: float
    wanted_groups: int | None = None
    step_s: float = 0.0
    rollouts_kept_from: int = 1
    step: int = 0
    target_steps: int | None = None

    def to_json(self) -> bytes:
        """Serialize for the bucket."""
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> RunStatus | None:
        """Parse strictly; ``None`` for anything malformed (the object is untrusted).

        Args:
            data: the stored bytes.
        """
        if len(data) > MAX_STATUS_BYTES:
            return None
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None
        if not isinstance(d, dict) or d.get("state") not in STATES:
            return None
        ints = ("version", "rollouts_kept_from")
        floats = ("updated_at", "heartbeat_at", "step_s")
        if not all(type(d.get(k)) is int and d[k] >= 0 for k in ints):
            return None
        step, target = d.get("step", 0), d.get("target_steps")  # absent in a status of an older trainer
        if type(step) is not int or step < 0 or not (target is None or (type(target) is int and target >= 0)):
            return None
        if not all(type(d.get(k)) in (int, float) and math.isfinite(d[k]) for k in floats):
            return None
        wanted = d.get("wanted_groups")
        if wanted is not None and type(wanted) is not int:
            return None
        return cls(d["state"], d["version"], float(d["updated_at"]), float(d["heartbeat_at"]), wanted,
                   float(d["step_s"]), d["rollouts_kept_from"], step, target)


def read_status(bucket: Bucket, run_id: str) -> RunStatus | None:
    """The run's status, or ``None`` when absent or malformed (bucket errors propagate).

    Args:
        bucket: the run's bucket.
        run_id: the run id.
    """
    try:
        return RunStatus.from_json(bucket.get(status_key(run_id)))
    except ObjectNotFound:
        return None


@dataclass(frozen=True)
class Verdict:
    """What a worker should do now.

    Args:
        action: ``sample``, ``pause`` or ``exit``.
        reason: one line for the log (empty for ``sample``).
        kind: short label for metrics: ``""``, ``finished``, ``stale``, ``failed`` or ``backpressure``.
    """

    action: str
    reason: str = ""
    kind: str = ""


SAMPLE = Verdict("sample")


class RunWatch:
    """A worker's view of the run's status, re-read at most every ``min_interval_s``.

    Args:
        bucket: the run's bucket.
        run_id: the run id.
        stale_s: pause when the trainer's heartbeat has not moved for this long (seconds).
        min_interval_s: re-read the status at most this often (a conditional GET).
        backpressure: honour ``wanted_groups`` (False: sample regardless).
        clock: monotonic clock (tests pass a fake one).
    """

    def __init__(self, bucket: Bucket, run_id: str, *, stale_s: float, min_interval_s: float,
                 backpressure: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.bucket, self.run_id = bucket, run_id
        self.stale_s, self.min_interval_s, self.backpressure = stale_s, min_interval_s, backpressure
        self._clock = clock
        self.status: RunStatus | None = None
        self._etag: str | None = None
        self._read_at: float | None = None
        self._beat: float | None = None
        self._beat_seen_at = 0.0
        self._spent = 0

    def _refresh(self) -> None:
        now = self._clock()
        if self._read_at is not None and now - self._read_at < self.min_interval_s:
            return
        self._read_at = now
        try:
            got = self.bucket.get_if_changed(status_key(self.run_id), self._etag)
        except ObjectNotFound:
            self.status, self._etag = None, None
            return
        except BucketError:
            return  # keep what we knew; the next poll tries again
        if got is None:
            return
        data, self._etag = got
        self.status, self._spent = RunStatus.from_json(data), 0  # a new status: a new want to sample for
        if self.status is not None and self.status.heartbeat_at != self._beat:
            self._beat, self._beat_seen_at = self.status.heartbeat_at, now

    def wanted(self) -> int | None:
        """The groups the trainer still wants from this worker, when backpressure applies: the status's want less
        what this worker sampled since it read that status (None: no limit known)."""
        s = self.status
        if not self.backpressure or s is None or s.state != "running" or s.wanted_groups is None:
            return None
        return max(0, s.wanted_groups - self._spent)

    def spend(self, groups: int) -> None:
        """Count groups this worker uploaded against the current status's want.

        Args:
            groups: the groups just uploaded.
        """
        self._spent += groups

    def check(self) -> Verdict:
        """Read the status if due and say whether to sample, pause or exit."""
        self._refresh()
        s = self.status
        if s is None:
            return SAMPLE
        if s.state == "finished":
            return Verdict("exit", f"run {self.run_id!r} finished at v{s.version}", "finished")
        quiet = self._clock() - self._beat_seen_at
        if quiet > max(self.stale_s, 3 * s.step_s):
            return Verdict("pause", f"the trainer's heartbeat has not moved for {quiet:.0f}s", "stale")
        if s.state == "failed":
            return Verdict("pause", f"the trainer failed at v{s.version}; waiting for a restart", "failed")
        if self.backpressure and s.wanted_groups is not None and s.wanted_groups - self._spent <= 0:
            why = "wants no more groups" if s.wanted_groups <= 0 else f"got the {s.wanted_groups} groups it wanted"
            return Verdict("pause", f"the trainer {why} at v{s.version} (backpressure)", "backpressure")
        return SAMPLE
