"""The fleet's speed as the trainer publishes it (``fleet_rate`` in the run status, groups per minute): the sum
of the speeds its live workers report, bounded, so each worker can take its share of the want by speed
(``stoa.worker.rate``, docs/fleet.md "Pacing").

A worker reports its speed on every record it writes: ``timings["generate_s"]``, the seconds it spent sampling
that group, so its speed is ``60 / generate_s`` groups per minute. It costs no request: the trainer reads the
records anyway, and only accepted (validated) records are counted. The report is untrusted:

- a speed that is not a number the trainer can use (``generate_s`` absent, <= 0, or a speed outside
  ``[MIN_RATE, MAX_RATE]``: 0, negative, 1e9 groups/min) is ``rejected``: never used, the worker counts at the
  fleet's median speed;
- a speed above ``max_ratio`` times the median speed (four rated workers at least) is counted at that cap
  (``capped`` says how many are): a liar can lower the others' shares by at most ``max_ratio`` medians' worth,
  never starve them;
- a worker that delivers more groups than twice its share of what the fleet delivered in the last ``live_s``
  (plus two) is flooding: each group beyond that is counted in ``excess`` (the pool still applies its own caps).

Workers counted live (``stoa.trainer.liveness``) without a rated record yet count at the median speed.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter, deque
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
        """Workers whose speed is counted at the cap (``max_ratio`` x the median), as of the last update."""
        self._cap = math.inf
        self.excess = 0
        """Groups a worker delivered beyond twice its share of the fleet's deliveries (plus two)."""

    def update(self, entries: Iterable[Any], workers: int) -> float | None:
        """Note the records of pool entries not seen before; return the fleet's speed (None: nobody rated).
        Costs ``O(new records + workers + records of the last live_s)`` per call, whatever the fleet's size.

        Args:
            entries: the pool's entries now (``content_id`` and ``record`` with ``worker_id`` and ``timings``).
            workers: the live workers the trainer counts (``LiveWorkers.count``).
        """
        now = self._clock()
        current, fresh = set(), Counter()
        for e in entries:
            current.add(e.content_id)
            if e.content_id not in self._entries:
                self._note(e.record.worker_id, e.record.timings.get("generate_s"), now)
                fresh[e.record.worker_id] += 1
        self._entries = current
        for wid in [w for w, t in self._seen_at.items() if now - t > self.live_s]:
            del self._seen_at[wid], self._delivered[wid]
            self.rates.pop(wid, None)
        for times in self._delivered.values():
            while times and times[0] < now - self.live_s:
                times.popleft()
        if not self.rates:
            return None
        median = statistics.median(self.rates.values())
        self._cap = self.max_ratio * median if len(self.rates) >= 4 else math.inf
        self.capped = sum(1 for r in self.rates.values() if r > self._cap)
        self._count_excess(fresh, median)
        counted = sum(self.bounded(w) for w in self.rates)
        return counted + max(0, workers - len(self.rates)) * median

    def bounded(self, worker_id: str) -> float:
        """A rated worker's speed as the fleet sum counts it: at most ``max_ratio`` x the median speed (when four
        workers are rated, so that one liar cannot move the median far), as of the last :meth:`update`.

        Args:
            worker_id: a worker in ``rates``.
        """
        return min(self.rates[worker_id], self._cap)

    def _note(self, worker_id: str, generate_s: float | None, now: float) -> None:
        self._seen_at[worker_id] = now
        self._delivered.setdefault(worker_id, deque()).append(now)
        rate = 60.0 / generate_s if generate_s is not None and generate_s > 0 else math.nan
        if not MIN_RATE <= rate <= MAX_RATE:
            self.rejected += 1
            return
        old = self.rates.get(worker_id)
        self.rates[worker_id] = rate if old is None else ALPHA * rate + (1 - ALPHA) * old

    def _count_excess(self, fresh: Counter[str], median: float) -> None:
        """Count, of the groups each worker just delivered, those beyond twice its share of the fleet's deliveries
        in the last ``live_s`` plus two (share by bounded speed; the median for an unrated worker)."""
        if len(self._delivered) < 2:
            return
        speeds = {w: self.bounded(w) if w in self.rates else median for w in self._delivered}
        fleet, total = sum(speeds.values()), sum(len(q) for q in self._delivered.values())
        for wid, n in fresh.items():
            if wid in speeds:
                over = len(self._delivered[wid]) - (2 * total * speeds[wid] / fleet + 2)
                self.excess += min(n, max(0, math.ceil(over)))
