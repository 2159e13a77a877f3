"""How a worker paces itself by the run's status (``runs/<run>/status.json``, read by ``stoa.lifecycle``).

The trainer overwrites it at start, once per published version (after the pool listing that follows the
publish, so the want is fresh), every ``status_seconds`` while it waits for records (its heartbeat), and at
exit (``finished`` or ``failed``). Workers read it with a conditional GET next to their pointer poll and
decide, in :meth:`RunWatch.check`, whether to sample, pause or exit:

- ``finished``: exit 0 (the trainer took its steps or stopped cleanly);
- the heartbeat has not moved for ``stale_s`` (or three of the trainer's last step times, if longer),
  or the trainer ``failed``: pause until it moves again (a restarted trainer writes ``running``);
- ``wanted_groups <= 0``: pause (backpressure: the pool already holds what the trainer can use before it
  goes stale, groups it skipped for equal rewards included); while it is positive the want is shared among
  the ``workers`` the trainer counts (below): a worker samples at most its share (:meth:`RunWatch.spend`),
  then pauses until a status grants it another.

Sharing the want (docs/fleet.md, "Backpressure"). The trainer publishes ``workers``, the workers it counts
live: the ids on records it accepted in the last ``LIVE_S`` seconds plus the ids of presence objects
(``runs/<run>/workers/<id>-<seq>``, empty, create-only) it listed in that time. A worker writes one when it
joins and again only after ``PRESENCE_S`` without an upload (its records prove it is alive meanwhile); the
trainer lists that prefix once per status heartbeat (one LIST, whatever the fleet's size) and deletes what it
listed. A worker's share of a grant is ``want / workers`` with randomized rounding (``floor(want / workers +
u)``, ``u`` a hash of the worker id, the status and the grant's number): the fleet's shares add up to the want
on average, a single worker's share is the whole want, and no worker needs to know another. A status grants
anew (:meth:`RunWatch._regrant`) when its version moved or its want rose and one of the worker's own batch
times passed since its last grant, when the want moved at all and the last grant gave this worker nothing (it
has nothing in flight), or after ``REGRANT_BATCHES`` batch times (groups granted and lost); a heartbeat alone
grants nothing, because the groups granted may still be in flight, unseen by the trainer's want.

Why quotas and not claims or leases on slots: a claim object per group doubles the bucket's billed writes
(PUT is R2's costly Class A) and leases need renewals and listings that grow with the fleet, while a presence
object costs one PUT per join (or per idle ``PRESENCE_S``) and the count one LIST per heartbeat. A crashed
worker holds nothing: others draw again after their batch times, and it leaves the count ``LIVE_S`` after its
last record or presence. A worker that ignores its share can fill the want before others (the trainer then
wants less), but only with records the trainer accepts; what it writes beyond the window goes stale: waste,
never a lock that keeps others out. A new worker announces itself and draws once the trainer counted it (its
presence object is gone: a HEAD per status read until then), within one status heartbeat, or after
``JOIN_WAIT_S`` if it never is (say its credentials may not write presence objects): a share of a count that
leaves it out would overshoot when many join at once. A status without ``workers`` (an older trainer) gives
every worker the whole want at every status, as before.

Pacing by speed (``pacing``, the worker default; docs/fleet.md "Pacing", :mod:`stoa.worker.rate`): once a worker
measured a batch and the status carries ``fleet_rate``, its share is the want times its speed over the fleet's
instead of over the count; its batches hold what it samples in a quarter of the window's time (a probe before
its first measure); and when the status's ``use_rate`` is below the fleet's speed it waits after each batch
(``Verdict`` kind ``pacing``) so that the fleet samples about what the trainer trains.

When in doubt it samples: a missing, unreadable or malformed status means "sample". Staleness is measured
on the worker's own monotonic clock (time since the heartbeat value last changed), so clock skew between
machines does not matter. Anyone who can write the bucket can write this object: it only steers pausing,
and a forged ``finished`` stops workers, not the trainer. Stdlib and the bucket layer only.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from stoa.bucket import Bucket, BucketError, ObjectNotFound
from stoa.layout import presence_key, status_key
from stoa.lifecycle import PRESENCE_S
from stoa.schemas.control import RunStatus
from stoa.worker.rate import RateMeter, batch_for_rate, duty, rate_share

REGRANT_BATCHES = 2.0
"""A status at the granting one's version, with no larger want, grants anew only after this many of the worker's
batch times (until then the groups granted may be in flight)."""
FIRST_BATCH_S = 30.0
"""A worker's batch time before it measured one (it paces how often an idle worker draws again)."""
JOIN_WAIT_S = 30.0
"""Longest a worker waits for the trainer's first count before it samples the whole want (fail open)."""
MIN_PAUSE_S = 0.01
"""Shortest wait ``RunWatch.pause_s`` gives (a pace that ends now still waits this long: no busy loop)."""


@dataclass(frozen=True)
class Verdict:
    """What a worker should do now.

    Args:
        action: ``sample``, ``pause`` or ``exit``.
        reason: one line for the log (empty for ``sample``).
        kind: short label for metrics: ``""``, ``finished``, ``stale``, ``failed``, ``backpressure`` or ``pacing``.
    """

    action: str
    reason: str = ""
    kind: str = ""


SAMPLE = Verdict("sample")


def share(wanted: int, workers: int, u: float) -> int:
    """One worker's share of ``wanted`` groups among ``workers``: ``floor(wanted / workers + u)`` in integers, so
    that with ``u`` uniform in ``[0, 1)`` the shares of all workers add up to ``wanted`` on average.

    Args:
        wanted: the groups the trainer wants (>= 0).
        workers: the workers sharing them (>= 1).
        u: this worker's draw in ``[0, 1)``.
    """
    base, rest = divmod(wanted, workers)
    return base + (1 if u * workers < rest else 0)


def draw(worker_id: str, status: RunStatus, grant: int = 0) -> float:
    """A worker's draw for one grant of a status, uniform in ``[0, 1)``: a hash of its id, the status's version
    and time and the grant's number (independent across workers and grants, reproducible, no state to keep).

    Args:
        worker_id: the worker's id.
        status: the status read.
        grant: the worker's count of grants so far.
    """
    h = hashlib.sha256(f"{worker_id}|{status.version}|{status.updated_at!r}|{grant}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


class RunWatch:
    """A worker's view of the run's status, re-read at most every ``min_interval_s``, and its share of the want.

    Args:
        bucket: the run's bucket.
        run_id: the run id.
        stale_s: pause when the trainer's heartbeat has not moved for this long (seconds).
        min_interval_s: re-read the status at most this often (a conditional GET).
        backpressure: honour ``wanted_groups`` (False: sample regardless).
        clock: monotonic clock (tests pass a fake one).
        worker_id: this worker's id: it names its presence objects and seeds its draws (empty: no presence).
        pacing: share the want by speed, size batches to land inside the window and space them by ``duty``
            (``stoa.worker.rate``; the worker setting ``pacing``, on by default; off without ``backpressure``).
        staleness_bound: the run's staleness bound (batch sizing).
    """

    def __init__(self, bucket: Bucket, run_id: str, *, stale_s: float, min_interval_s: float,
                 backpressure: bool = True, clock: Callable[[], float] = time.monotonic, worker_id: str = "",
                 pacing: bool = False, staleness_bound: int = 3) -> None:
        self.bucket, self.run_id, self.worker_id = bucket, run_id, worker_id
        self.pacing, self.staleness_bound = pacing and backpressure, staleness_bound  # no backpressure: no pace
        self.meter = RateMeter()
        """This worker's speed (groups per minute over its batches)."""
        self.bad_status = 0
        """Status objects read and refused (malformed: read as absent)."""
        self.bad_rates = 0
        """Statuses whose ``fleet_rate`` is not positive (shared by the count instead)."""
        self.paced_until = 0.0
        """When pacing: the next batch waits until then (the last batch's seconds / ``duty``)."""
        self.stale_s, self.min_interval_s, self.backpressure = stale_s, min_interval_s, backpressure
        self._clock = clock
        self.status: RunStatus | None = None
        self._etag: str | None = None
        self._read_at: float | None = None
        self._beat: float | None = None
        self._beat_seen_at = 0.0
        self._spent = 0
        self._grant: RunStatus | None = None
        """The status this worker's share was drawn from (``_spent`` counts against it)."""
        self._grant_at = 0.0
        self.grants = 0
        """Shares drawn so far."""
        self._batch_at: float | None = None
        self._batch_s = FIRST_BATCH_S
        """Seconds of this worker's last batch, sampling and upload (a guess before the first)."""
        self._active_at: float | None = None
        """When this worker last uploaded or announced itself (None: never)."""
        self._joined_at: float | None = None
        self._counted = not worker_id
        """Whether the trainer has counted this worker (it deleted the presence object); no id: no presence."""
        self._grant_joined = False
        self.announced = 0
        """Presence objects written."""

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
        self.status = RunStatus.from_json(data)
        if self.status is None:
            self.bad_status += 1
        elif self.status.fleet_rate is not None and not self.status.fleet_rate > 0:
            self.bad_rates += 1
        self._check_counted()
        self._regrant(now)
        if self.status is not None and self.status.heartbeat_at != self._beat:
            self._beat, self._beat_seen_at = self.status.heartbeat_at, now

    def _regrant(self, now: float) -> None:
        """Draw a new share from the status just read (see the module's "Sharing the want"): at once when the
        state changed, the status has no count (an older trainer: every status grants), or this worker was just
        counted into a fleet of none (or gave up waiting); when the grant gave this worker nothing and the want
        or version moved (a newcomer counted into a fleet waits for that: the want it reads was granted to the
        others already); after one of its batch times when the version moved or the want rose; after
        ``REGRANT_BATCHES`` of them in any case (groups granted then and lost are granted again). Until then the
        groups granted may be in flight, unseen by the trainer's want: granting them again would multiply them."""
        s, g = self.status, self._grant
        if (s is None or g is None or s.workers is None or s.state != g.state
                or (self._joined() and not self._grant_joined and (not self._counted or not g.workers))):
            fresh = True
        else:
            since = now - self._grant_at
            moved = (s.version, s.wanted_groups) != (g.version, g.wanted_groups)
            more = s.version != g.version or (s.wanted_groups or 0) > (g.wanted_groups or 0)
            fresh = ((moved and not self._drew) or since >= REGRANT_BATCHES * self._batch_s
                     or (more and since >= self._batch_s))
        if fresh:
            self._grant, self._grant_at, self._spent = s, now, 0
            self._grant_joined = self._joined()
            self.grants += 1

    @property
    def _drew(self) -> bool:
        """Whether the grant gave this worker any group (none: it has nothing in flight of it)."""
        return bool(self._share)

    @property
    def _share(self) -> int | None:
        """This worker's groups of the granting status (None: no limit)."""
        s = self._grant if self.status is not None else None
        if not self.backpressure or s is None or s.state != "running" or s.wanted_groups is None:
            return None
        if s.workers is None:  # an older trainer: no count to share by
            return s.wanted_groups
        if not self._grant_joined:
            return 0  # not counted yet: a share of a count without this worker would overshoot
        return self._portion(s)

    def _portion(self, s: RunStatus) -> int:
        """This worker's draw of a counted status's want: by its speed when pacing, the status has a positive
        ``fleet_rate`` and this worker measured a batch (``stoa.worker.rate.rate_share``), else by the count."""
        wanted, workers, u = s.wanted_groups or 0, max(1, s.workers or 0), draw(self.worker_id, s, self.grants)
        rate = self.meter.rate
        if self.pacing and rate is not None and s.fleet_rate is not None and s.fleet_rate > 0:
            return rate_share(wanted, workers, rate, s.fleet_rate, u)
        return share(wanted, workers, u)

    def _joined(self) -> bool:
        """Whether this worker may draw: the trainer counted it, or it waited ``JOIN_WAIT_S`` for that."""
        return self._counted or (self._joined_at is not None and self._clock() - self._joined_at >= JOIN_WAIT_S)

    def _check_counted(self) -> None:
        """On a new status: the trainer deletes the presence objects it counted, so this worker is counted
        once its first one is gone (one HEAD per status read until then)."""
        s = self.status
        if self._counted or not self.announced or s is None or s.workers is None:
            return
        try:
            self._counted = not self.bucket.exists(presence_key(self.run_id, self.worker_id, 0))
        except BucketError:
            pass

    def _announce(self) -> None:
        """Write a presence object when the trainer counts workers and this one wrote nothing for ``PRESENCE_S``.
        A refused or failed write is tried again ``PRESENCE_S`` later (credentials without the presence prefix
        cost one request a minute; the worker still samples after ``JOIN_WAIT_S``)."""
        s, now = self.status, self._clock()
        if not (self.worker_id and self.backpressure and s is not None and s.workers is not None
                and s.state == "running"):
            return
        if self._active_at is not None and now - self._active_at < PRESENCE_S:
            return
        self._active_at = now
        self._joined_at = now if self._joined_at is None else self._joined_at
        try:
            self.bucket.put_create(presence_key(self.run_id, self.worker_id, self.announced), b"")
        except BucketError:
            return
        self.announced += 1

    def wanted(self) -> int | None:
        """The groups the trainer still wants from this worker, when backpressure applies: its share of the
        granting status's want less what it sampled since, at most its share of the status read now (None: no
        limit known)."""
        if self._share is None:
            return None
        s = self.status
        if s is None or s.wanted_groups is None or s.workers is None or not self._grant_joined:
            now = self._share if s is None or s.wanted_groups is None else s.wanted_groups
        else:  # what this worker's draw gives of the want and count now (the fleet may have grown since)
            now = self._portion(s)
        return max(0, min(self._share - self._spent, now))

    def batch(self, k: int) -> int:
        """Groups to sample now: ``k``, or fewer when this worker's share of the want is smaller or, when
        pacing, when ``k`` groups at its speed would not land inside the window (``batch_for_rate``).

        Args:
            k: the groups the worker would sample (its groups in flight).
        """
        self._batch_at = self._clock()
        s = self.status
        if self.pacing and s is not None:
            k = batch_for_rate(k, self.meter.rate, s.step_s, self.staleness_bound)
        left = self.wanted()
        return min(k, left) if left is not None and left > 0 else k

    def spend(self, groups: int) -> None:
        """Count groups this worker uploaded against its share of the current status's want.

        Args:
            groups: the groups just uploaded.
        """
        self._spent += groups
        self._active_at = self._clock()
        if self._batch_at is not None:
            self._batch_s, self._batch_at = self._active_at - self._batch_at, None
            self.meter.add(groups, self._batch_s)
            s = self.status
            if self.pacing and s is not None:
                self.paced_until = self._active_at + self._batch_s * (1 / duty(s.fleet_rate, s.use_rate) - 1)

    def check(self) -> Verdict:
        """Read the status if due, announce this worker if due, and say whether to sample, pause or exit."""
        self._refresh()
        self._announce()
        if not self._grant_joined and self._joined():
            self._regrant(self._clock())  # waited JOIN_WAIT_S without a new status: draw now
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
        if self.wanted() == 0:
            return Verdict("pause", f"the trainer {self._why(s)} at v{s.version} (backpressure)", "backpressure")
        if self.pacing and self._clock() < self.paced_until:
            return Verdict("pause", f"pacing to {100 * duty(s.fleet_rate, s.use_rate):.0f}% of this worker's speed "
                                    f"(the fleet samples {s.fleet_rate} groups/min, the trainer trains {s.use_rate})",
                           "pacing")
        return SAMPLE

    def pause_s(self, verdict: Verdict, default_s: float) -> float:
        """Seconds to wait on a ``pause`` verdict before checking again: ``default_s``, or, pacing, until the pace
        ends if that is sooner (at least ``MIN_PAUSE_S``): a paced worker starts its next batch on time instead of
        at its next poll (a poll tick after every batch idled a fast worker's 20 s batches by 5%).

        Args:
            verdict: what :meth:`check` said.
            default_s: the wait between checks otherwise (the worker's status or poll seconds).
        """
        if verdict.kind != "pacing":
            return default_s
        return min(default_s, max(MIN_PAUSE_S, self.paced_until - self._clock()))

    def _why(self, s: RunStatus) -> str:
        if s.wanted_groups is not None and s.wanted_groups <= 0:
            return "wants no more groups"
        if s.workers is None:
            return f"got the {s.wanted_groups} groups it wanted"
        if not self._joined():
            return "has not counted this worker yet"
        return f"got this worker's share ({self._share} of {s.wanted_groups} groups among {s.workers} workers)"
