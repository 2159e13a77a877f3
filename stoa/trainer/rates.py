"""The fleet's speed as the trainer publishes it (``fleet_rate`` in the run status, groups per minute): the sum
of the speeds its live workers report, bounded, so each worker can take its share of the want by speed
(``stoa.worker.rate``, docs/fleet.md "Pacing").

A worker reports its speed on every record it writes: ``timings["generate_s"]``, the seconds it spent sampling
that group, so its speed is ``60 / generate_s`` groups per minute. It costs no request: the trainer reads the
records anyway, and only accepted (validated) records are counted. The report is untrusted:

- a speed that is not a number the trainer can use (``generate_s`` absent, <= 0, or a speed outside
  ``[MIN_RATE, MAX_RATE]``: 0, negative, 1e9 groups/min) is ``rejected``: never used, the worker counts at the
  fleet's median speed;
- a speed above ``max_ratio`` times the median of the other rated workers (three at least) is ``capped`` there:
  a liar can lower the others' shares by at most ``max_ratio`` medians' worth, never starve them;
- a worker that delivers more groups than twice its share of what the fleet delivered in the last ``live_s``
  (plus two) is flooding: each group beyond that is counted in ``excess`` (the pool still applies its own caps).

Workers counted live (``stoa.trainer.liveness``) without a rated record yet count at the median speed.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from stoa.lifecycle import LIVE_S

MIN_RATE = 1e-3
"""Slowest speed believed, groups per minute (a group in about 17 hours)."""
MAX_RATE = 1e5
"""Fastest speed believed, groups per minute."""
MAX_RATIO = 50.0
"""Most a worker's counted speed may exceed the median of the others' (default of ``max_ratio``)."""
ALPHA = 0.3
"""Weight of the newest report in a worker's moving average."""


class FleetRates:
    """Per-worker speeds from accepted records, bounded; :meth:`update` returns the fleet's sum.

    Args:
        live_s: forget a worker's speed this long after its last accepted record.
        max_ratio: cap on a speed relative to the median of the others'.
        clock: monotonic clock (tests pass a fake one).
    """

    def __init__(self, live_s: float = LIVE_S, max_ratio: float = MAX_RATIO,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.live_s, self.max_ratio, self._clock = live_s, max_ratio, clock
        self.rates: dict[str, float] = {}
        """Each worker's speed (moving average of its believed reports), groups per minute."""
        self._seen_at: dict[str, float] = {}
        self._delivered: dict[str, deque[float]] = {}
        self._entries: set[str] = set()
        self.rejected = 0
        """Reports not believed (absent, <= 0, outside ``[MIN_RATE, MAX_RATE]``)."""
        self.capped = 0
        """Reports above ``max_ratio`` x the median of the other workers' speeds (counted at that cap)."""
        self.excess = 0
        """Groups a worker delivered beyond twice its share of the fleet's deliveries (plus two)."""

    def update(self, entries: Iterable[Any], workers: int) -> float | None:
        """Note the records of pool entries not seen before; return the fleet's speed (None: nobody rated).

        Args:
            entries: the pool's entries now (``content_id`` and ``record`` with ``worker_id`` and ``timings``).
            workers: the live workers the trainer counts (``LiveWorkers.count``).
        """
        now = self._clock()
        current = set()
        for e in entries:
            current.add(e.content_id)
            if e.content_id not in self._entries:
                self._note(e.record.worker_id, e.record.timings.get("generate_s"), now)
        self._entries = current
        for wid in [w for w, t in self._seen_at.items() if now - t > self.live_s]:
            del self._seen_at[wid], self._delivered[wid]
            self.rates.pop(wid, None)
        if not self.rates:
            return None
        counted = sum(self.bounded(w) for w in self.rates)
        return counted + max(0, workers - len(self.rates)) * statistics.median(self.rates.values())

    def bounded(self, worker_id: str) -> float:
        """A rated worker's speed as the fleet sum counts it: at most ``max_ratio`` x the others' median (when
        three others are rated).

        Args:
            worker_id: a worker in ``rates``.
        """
        rate = self.rates[worker_id]
        others = [r for w, r in self.rates.items() if w != worker_id]
        if len(others) < 3:
            return rate
        return min(rate, self.max_ratio * statistics.median(others))

    def _note(self, worker_id: str, generate_s: float | None, now: float) -> None:
        self._seen_at[worker_id] = now
        times = self._delivered.setdefault(worker_id, deque())
        times.append(now)
        while times[0] < now - self.live_s:
            times.popleft()
        self._count_excess(worker_id, now)
        rate = 60.0 / generate_s if generate_s is not None and generate_s > 0 else math.nan
        if not MIN_RATE <= rate <= MAX_RATE:
            self.rejected += 1
            return
        old = self.rates.get(worker_id)
        self.rates[worker_id] = rate if old is None else ALPHA * rate + (1 - ALPHA) * old
        if self.bounded(worker_id) < self.rates[worker_id]:
            self.capped += 1

    def _count_excess(self, worker_id: str, now: float) -> None:
        """Count the group just delivered as excess when the worker delivered more than twice its share of the
        fleet's deliveries in the last ``live_s`` plus two (share by speed; the median for an unrated worker)."""
        total = sum(sum(1 for t in q if t >= now - self.live_s) for q in self._delivered.values())
        if not self.rates or len(self._delivered) < 2:
            return
        median = statistics.median(self.rates.values())
        speeds = {w: self.bounded(w) if w in self.rates else median for w in self._delivered}
        fraction = speeds[worker_id] / sum(speeds.values())
        if len(self._delivered[worker_id]) > 2 * fraction * total + 2:
            self.excess += 1
