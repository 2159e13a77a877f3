"""The trainer's side of the run lifecycle: the status object (heartbeat, want) and rollout retention.

Cost per published version: one status PUT, and, once a version leaves the window plus
``keep_rollout_versions``, one listing and one bulk delete of that version's prefix (never again: the
oldest kept version is carried in the status, so a restart does not re-list deleted versions). While the
trainer waits for records it rewrites the status every ``status_seconds`` (its heartbeat), and lists the window
less often the longer nothing lands (``poll_delay``). A status write that fails is logged and retried at the
next beat: it never stops training.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from stoa.bucket import Bucket, BucketError
from stoa.layout import rollout_version_prefix, status_key
from stoa.lifecycle import RunStatus, read_status

log = logging.getLogger(__name__)

POLL_BACKOFF_MAX_S = 5.0
"""Longest wait between two listings of an idle trainer (unless ``poll_seconds`` is longer)."""


def poll_delay(poll_seconds: float, empty_polls: int) -> float:
    """Seconds before the next listing while the trainer waits for records.

    Every listing of the window costs one LIST per version (R2's Class A); a trainer that waits on a quiet fleet
    would otherwise pay them every ``poll_seconds``. The wait doubles with each listing that brought no new record,
    up to ``min(5 s, 10 x poll_seconds)`` (never below ``poll_seconds``), and falls back once records land.

    Args:
        poll_seconds: the configured wait.
        empty_polls: listings in a row that accepted nothing (0: the last one did).
    """
    cap = max(poll_seconds, min(POLL_BACKOFF_MAX_S, 10 * poll_seconds))
    return min(cap, poll_seconds * 2 ** min(empty_polls, 30))


def wanted_groups(groups_per_step: int, staleness_bound: int, available: int) -> int:
    """Groups the trainer can still use before they go stale: one step's groups for each version a record
    sampled now stays inside the window (``staleness_bound + 1``), minus the usable groups already pooled.

    Args:
        groups_per_step: groups one optimizer step takes.
        staleness_bound: the run's staleness bound.
        available: usable groups in the pool now.
    """
    return max(0, groups_per_step * (staleness_bound + 1) - available)


class StatusPublisher:
    """Writes ``status.json``: on a new version, on a heartbeat every ``heartbeat_s``, and at exit.

    Args:
        bucket: the run's bucket.
        run_id: the run id.
        heartbeat_s: rewrite at least this often while the version does not move.
        fence: called before every write; raises when this trainer may no longer write (its lease).
        clock: wall clock for the stored times.
        mono: monotonic clock for the heartbeat interval.
    """

    def __init__(self, bucket: Bucket, run_id: str, heartbeat_s: float, *, fence: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic) -> None:
        self.bucket, self.run_id, self.heartbeat_s = bucket, run_id, heartbeat_s
        self.fence = fence
        self._clock, self._mono = clock, mono
        self._written_at: float | None = None
        self._version: int | None = None
        self.writes = 0
        """Status objects written by this process."""
        try:
            prior = read_status(bucket, run_id)
        except BucketError:
            prior = None
        self.prior = prior
        """The status a previous trainer left (None on a new run or when unreadable)."""

    def beat(self, version: int, wanted: int | None, *, step_s: float, kept_from: int) -> bool:
        """Write ``running`` if the version moved or the heartbeat is due; return whether it wrote.

        Args:
            version: the newest published version.
            wanted: groups still wanted (None: no backpressure).
            step_s: the last step's seconds.
            kept_from: the oldest rollout version retention keeps.
        """
        due = self._written_at is None or self._mono() - self._written_at >= self.heartbeat_s
        if version == self._version and not due:
            return False
        return self.write("running", version, wanted, step_s=step_s, kept_from=kept_from)

    def write(self, state: str, version: int, wanted: int | None, *, step_s: float, kept_from: int) -> bool:
        """Write the status now; a bucket error is logged, not raised (the next beat retries).

        Args:
            state: ``running``, ``finished`` or ``failed``.
            version: the newest published version.
            wanted: groups still wanted (None: no backpressure).
            step_s: the last step's seconds.
            kept_from: the oldest rollout version retention keeps.
        """
        now = self._clock()
        status = RunStatus(state, version, now, now, wanted, round(step_s, 3), kept_from)
        if self.fence is not None:
            self.fence()
        try:
            self.bucket.put(status_key(self.run_id), status.to_json())
        except BucketError as e:
            log.warning("writing the run status failed, retrying at the next beat: %s", e)
            return False
        self._written_at, self._version = self._mono(), version
        self.writes += 1
        return True


class RolloutRetention:
    """Deletes whole rollout version prefixes once they fall out of the window plus ``keep_extra``.

    Args:
        bucket: the run's bucket.
        run_id: the run id.
        staleness_bound: the run's staleness bound (the window is ``current - staleness_bound .. current``).
        keep_extra: versions kept below the window (audit); -1 keeps every version.
        kept_from: the oldest version not yet deleted (from the previous trainer's status, else 1).
    """

    def __init__(self, bucket: Bucket, run_id: str, staleness_bound: int, keep_extra: int, kept_from: int = 1):
        self.bucket, self.run_id = bucket, run_id
        self.staleness_bound, self.keep_extra = staleness_bound, keep_extra
        self.kept_from = max(1, kept_from)

    def cutoff(self, current_version: int) -> int:
        """The oldest version kept at ``current_version`` (every version below it is deleted).

        Args:
            current_version: the newest published version.
        """
        return max(1, current_version - self.staleness_bound - self.keep_extra)

    def collect(self, current_version: int) -> int:
        """Delete every version prefix below the cutoff not deleted before; return objects deleted.

        A failed delete stops here and is retried at the next call (it is never skipped).

        Args:
            current_version: the newest published version.
        """
        if self.keep_extra < 0:
            return 0
        deleted = 0
        for v in range(self.kept_from, self.cutoff(current_version)):
            try:
                deleted += self.bucket.delete_prefix(rollout_version_prefix(self.run_id, v))
            except BucketError as e:
                log.warning("deleting rollouts of v%d failed, retrying after the next step: %s", v, e)
                break
            self.kept_from = v + 1
        return deleted
