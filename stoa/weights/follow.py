"""A worker's policy over :class:`WeightSync`: fail closed without dying.

Adopt verified weights when the pointer moves; when a sync is refused, keep the last verified weights
while they are at most ``staleness_bound`` versions behind the pointer (the trainer still uses records
made with them), retry with jittered exponential backoff, and report every refused object. Weights
further behind are useless to the trainer: the follower then says they are not usable, and the worker
stops sampling until a sync succeeds (it never exits over a bad object).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from stoa.bucket import BucketError
from stoa.layout import pointer_key
from stoa.weights.errors import SyncError
from stoa.weights.planes import State
from stoa.weights.sync import Refusal, WeightSync


@dataclass(frozen=True)
class FollowStep:
    """What one :meth:`WeightFollower.step` did.

    Args:
        adopted: (version, state) newly verified in this step, else None.
        refusals: objects refused in this step, each with key and reason (also when a fallback succeeded).
        error: why this step's poll or sync failed (None when it did not).
        version: the verified version held after the step (None before the first).
        target: the pointer's version as last read (None while the run has no readable pointer).
        usable: whether the held weights may be sampled with: held, and at most the staleness bound
            behind the pointer.
        retry_in: seconds until the next sync attempt is allowed (0 when none is pending).
    """

    adopted: tuple[int, State] | None
    refusals: list[Refusal] = field(default_factory=list)
    error: SyncError | None = None
    version: int | None = None
    target: int | None = None
    usable: bool = False
    retry_in: float = 0.0


class WeightFollower:
    """Follow a run's pointer with verified weights, backing off after failures.

    Args:
        sync: the worker's :class:`WeightSync`.
        staleness_bound: how many versions behind the pointer the held weights stay usable (the run
            contract's ``staleness_bound``).
        base_delay_s: backoff after the first failure (doubles per failure, equal jitter).
        max_delay_s: cap on one backoff.
        clock: monotonic clock (tests pass a fake one).
        rand: uniform [0, 1) source for the jitter.
    """

    def __init__(self, sync: WeightSync, staleness_bound: int, *, base_delay_s: float = 2.0,
                 max_delay_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 rand: Callable[[], float] = random.random) -> None:
        if staleness_bound < 0:
            raise ValueError(f"staleness_bound must be >= 0, got {staleness_bound}")
        self.sync = sync
        self.staleness_bound = staleness_bound
        self.base_delay_s = base_delay_s
        self.max_delay_s = max_delay_s
        self._clock = clock
        self._rand = rand
        self.failures = 0
        """Consecutive failed attempts (0 after a success)."""
        self.refused_total = 0
        """Objects refused since the follower started."""
        self._next_try = 0.0

    def delay(self, failures: int) -> float:
        """Backoff after ``failures`` consecutive failures: exponential, capped, half of it random.

        Args:
            failures: consecutive failures so far (>= 1).
        """
        base = min(self.max_delay_s, self.base_delay_s * 2 ** min(failures - 1, 30))
        return base / 2 + self._rand() * base / 2

    def _result(self, adopted: tuple[int, State] | None = None, refusals: list[Refusal] | None = None,
                error: SyncError | None = None) -> FollowStep:
        held = self.sync.version if self.sync.state is not None else None
        target = self.sync.pointer.version if self.sync.pointer is not None else None
        usable = held is not None and (target is None or target - held <= self.staleness_bound)
        refusals = refusals or []
        self.refused_total += len(refusals)
        return FollowStep(adopted, refusals, error, held, target, usable,
                          max(0.0, self._next_try - self._clock()))

    def _failed(self, error: SyncError, refusals: list[Refusal]) -> FollowStep:
        self.failures += 1
        self._next_try = self._clock() + self.delay(self.failures)
        return self._result(None, refusals, error)

    def step(self) -> FollowStep:
        """Poll the pointer and, when behind and not backing off, sync to it. Never raises over a bad
        object or an unreachable bucket: both come back as ``error`` (refused objects in ``refusals``).
        While backing off it only re-reads the pointer, so ``usable`` follows the run."""
        if self._clock() < self._next_try:  # backing off: only refresh the pointer (a cheap conditional GET)
            try:
                self.sync.poll()
            except (SyncError, BucketError):
                pass  # reported by the next attempt
            return self._result()
        try:
            pointer = self.sync.poll()
        except SyncError as e:  # malformed or foreign current.json: refuse it, keep what we have
            return self._failed(e, [Refusal(pointer_key(self.sync.run_id), e.reason, e.detail, "pointer")])
        except BucketError as e:
            return self._failed(SyncError("unavailable", f"polling the pointer: {e}"), [])
        if pointer is None:
            self.failures, self._next_try = 0, 0.0
            return self._result()
        try:
            version, state = self.sync.sync(pointer)
        except SyncError as e:
            return self._failed(e, list(self.sync.refusals))
        self.failures, self._next_try = 0, 0.0
        return self._result((version, state), list(self.sync.refusals))
