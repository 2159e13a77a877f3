"""The trainer's side of the run lifecycle: the status object (heartbeat, want) and rollout retention.

Cost per published version: one status PUT, and, once a version leaves the window plus
``keep_rollout_versions``, one listing and one bulk delete of that version's prefix (never again: the
oldest kept version is carried in the status, so a restart does not re-list deleted versions). While the
trainer waits for records it rewrites the status every ``status_seconds`` (its heartbeat) and whenever the want
reaches zero or rises, and lists the window less often the longer nothing lands (``poll_delay``). A status write
that fails is logged and retried at the next beat: it never stops training.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from stoa.bucket import Bucket, BucketError
from stoa.layout import rollout_version_prefix, status_key
from stoa.lifecycle import read_status
from stoa.schemas.control import RunStatus
from stoa.trainer.liveness import LiveWorkers
from stoa.trainer.rates import FleetRates

log = logging.getLogger(__name__)

REWRITE_S = 1.0
"""While workers share the want, a want that fell (still above zero) is rewritten at most this often: workers
that drew none of it draw again on the new one (the groups the others still owe)."""
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


def wanted_groups(groups_per_step: int, staleness_bound: int, available: int, skipped: int = 0) -> int:
    """Groups the trainer can still use before they go stale: one step's groups for each version a record
    sampled now stays inside the window (``staleness_bound + 1``), minus the usable groups already pooled and
    minus the groups skipped for equal rewards that :class:`UniformSkips` still counts (read, never trained).

    Args:
        groups_per_step: groups one optimizer step takes.
        staleness_bound: the run's staleness bound.
        available: usable groups in the pool now.
        skipped: skipped groups counted against the want (``UniformSkips.counted``).
    """
    return max(0, groups_per_step * (staleness_bound + 1) - available - skipped)


class UniformSkips:
    """Groups skipped for equal rewards (``skip_uniform_groups``) since the trainer's last step, as backpressure
    and the trainer's log see them.

    Skipped groups count against the want, so while every group is skipped the workers write about one window
    (``groups_per_step x (staleness_bound + 1)`` groups) and pause. Every ``forgive_s`` without a step the count
    is forgiven and they write one more window: a policy that may still sample a group with signal gets a bounded
    trickle, neither a flood of groups nobody trains nor a permanent stall. Once a whole window has been read
    without a step and every group taken was skipped, :meth:`note` returns one line naming the fix, once.

    Args:
        window: the groups of one window (``groups_per_step x (staleness_bound + 1)``).
        forgive_s: seconds without a step after which the skipped groups stop counting against the want.
        clock: monotonic clock (tests pass a fake one).
    """

    def __init__(self, window: int, forgive_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window, self.forgive_s, self._clock = window, forgive_s, clock
        self._step: int | None = None
        self._forgiven, self._since = 0, clock()
        self.noted = False

    def counted(self, skipped: int, step: int) -> int:
        """The skipped groups that count against the want now.

        Args:
            skipped: groups skipped since the last step (the pool's ``skipped_uniform``).
            step: the run's step count (a new step starts a new count).
        """
        now = self._clock()
        if step != self._step:
            self._step, self._forgiven, self._since = step, 0, now
        elif now - self._since >= self.forgive_s:
            self._forgiven, self._since = skipped, now
        return max(0, skipped - self._forgiven)

    def note(self, skipped: int, available: int, version: int) -> str | None:
        """One line naming the fix, the first time a whole window of groups was read since the last step and
        every one taken was skipped (else None).

        Args:
            skipped: groups skipped since the last step.
            available: groups waiting in the pool (not taken yet).
            version: the trainer's current version.
        """
        if self.noted or not skipped or skipped + available < self.window:
            return None
        self.noted = True
        return (f"[trainer] v{version}: all {skipped} groups since the last step had equal rewards and were skipped "
                "(no advantage, no gradient) and count against the want; to train on them set "
                "skip_uniform_groups = false (--no-skip-uniform-groups), or start from a model that solves some "
                "prompts (a cold start)")


class StatusPublisher:
    """Writes ``status.json``: on a new version, on a heartbeat every ``heartbeat_s``, and at exit; with a want it
    also counts the live workers (:class:`~stoa.trainer.liveness.LiveWorkers`) among whom the workers share it,
    and sums their reported speeds (:class:`~stoa.trainer.rates.FleetRates`) so they share it by speed.

    Args:
        bucket: the run's bucket.
        run_id: the run id.
        heartbeat_s: rewrite at least this often while the version does not move.
        fence: called before every write; raises when this trainer may no longer write (its lease).
        clock: wall clock for the stored times.
        mono: monotonic clock for the heartbeat interval and the worker count.
        target_steps: the run's total steps (0: unbounded), written into every status.
        groups_per_step: groups a step takes (0: no ``use_rate`` in the status).
    """

    def __init__(self, bucket: Bucket, run_id: str, heartbeat_s: float, *, fence: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic,
                 target_steps: int = 0, groups_per_step: int = 0) -> None:
        self.bucket, self.run_id, self.heartbeat_s = bucket, run_id, heartbeat_s
        self.groups_per_step = groups_per_step
        self.target_steps = target_steps
        self.fence = fence
        self._clock, self._mono = clock, mono
        self._written_at: float | None = None
        self._version: int | None = None
        self._wanted: int | None = None
        self._workers: int | None = None
        self.live = LiveWorkers(bucket, run_id, heartbeat_s, clock=mono)
        """The live workers the status shares the want among."""
        self.rates = FleetRates(clock=mono)
        """Their speeds, bounded (``rejected``, ``capped`` and ``excess`` count the reports not trusted)."""
        self._fleet_rate: float | None = None
        self.writes = 0
        """Status objects written by this process."""
        try:
            prior = read_status(bucket, run_id)
        except BucketError:
            prior = None
        self.prior = prior
        """The status a previous trainer left (None on a new run or when unreadable)."""

    def beat(self, version: int, wanted: int | None, *, step_s: float, kept_from: int, step: int = 0,
             seen: Iterable[Any] | None = None) -> bool:
        """Write ``running`` if the version moved, the heartbeat is due, the want reached zero (workers pause at
        once) or rose (groups left the pool: workers, which sample at most their share per status, get a new
        one), or the live workers rose (a newcomer gets a share); return whether it wrote.

        Args:
            version: the newest published version.
            wanted: groups still wanted (None: no backpressure, no worker count).
            step_s: the last step's seconds.
            kept_from: the oldest rollout version retention keeps.
            step: the run's steps so far.
            seen: the pool's entries now (their workers are live); None: no worker count.
        """
        seen = None if seen is None else list(seen)
        workers = None if wanted is None or seen is None else self.live.update(seen)
        if workers is not None and seen is not None:
            self._fleet_rate = self.rates.update(seen, workers)
        due = self._written_at is None or self._mono() - self._written_at >= self.heartbeat_s
        since = None if self._written_at is None else self._mono() - self._written_at
        moved = wanted != self._wanted and (wanted == 0 or (wanted or 0) > (self._wanted or 0)
                                            or (workers is not None and (since or 0) >= REWRITE_S))
        joined = (workers or 0) > (self._workers or 0)
        if version == self._version and not due and not moved and not joined:
            return False
        return self.write("running", version, wanted, step_s=step_s, kept_from=kept_from, step=step,
                          workers=workers)

    def write(self, state: str, version: int, wanted: int | None, *, step_s: float, kept_from: int,
              step: int = 0, workers: int | None = None) -> bool:
        """Write the status now; a bucket error is logged, not raised (the next beat retries).

        Args:
            state: ``running``, ``finished`` or ``failed``.
            version: the newest published version.
            wanted: groups still wanted (None: no backpressure).
            step_s: the last step's seconds.
            kept_from: the oldest rollout version retention keeps.
            step: the run's steps so far.
            workers: the live workers sharing the want (None: not counted).
        """
        now = self._clock()
        fleet = None if workers is None or self._fleet_rate is None else round(self._fleet_rate, 3)
        use = round(self.groups_per_step * 60 / step_s, 3) if self.groups_per_step and step_s > 0 else None
        status = RunStatus(state, version, now, now, wanted, round(step_s, 3), kept_from, step, self.target_steps,
                           workers, fleet, use)
        if self.fence is not None:
            self.fence()
        try:
            self.bucket.put(status_key(self.run_id), status.to_json())
        except BucketError as e:
            log.warning("writing the run status failed, retrying at the next beat: %s", e)
            return False
        self._written_at, self._version, self._wanted, self._workers = self._mono(), version, wanted, workers
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
        self.skipped = 0
        """Versions left in place because the bucket refused to name one of their keys (never retried)."""

    def cutoff(self, current_version: int) -> int:
        """The oldest version kept at ``current_version`` (every version below it is deleted).

        Args:
            current_version: the newest published version.
        """
        return max(1, current_version - self.staleness_bound - self.keep_extra)

    def collect(self, current_version: int) -> int:
        """Delete every version prefix below the cutoff not deleted before; return objects deleted.

        A failed delete (bucket outage) stops here and is retried at the next call. A version holding a key the
        bucket cannot name at all (``ValueError``; no backend raises it for a key its own listing returned) is
        left in place, logged and counted in ``skipped``, and never retried: one planted key never stops training.

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
            except ValueError as e:
                log.warning("rollouts of v%d hold a key the bucket cannot delete, left in place: %.200s", v, e)
                self.skipped += 1
            self.kept_from = v + 1
        return deleted
