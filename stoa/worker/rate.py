"""Per-worker pacing (docs/fleet.md, "Pacing"): a worker's own speed, its share of the want by speed, and a
batch size that lands inside the staleness window.

A worker measures its speed in groups per minute over its batches (sampling and upload, :class:`RateMeter`);
the trainer sums the speeds its workers report on their records (its ``rates`` module) into the status's
``fleet_rate``. A worker's share of the want is then ``want x rate / fleet_rate`` (randomized rounding, as the
count-based share), so a worker ten times faster draws ten times the groups and the fleet's draws finish
together instead of the fast ones idling while the slow ones owe the rest. A batch is sized so that it takes at
most ``LAND_FRACTION`` of the window's time (``(staleness_bound + 1) x step_s``): a slow worker's batch lands
while its version is still trained. Backpressure is a rate: when the fleet is faster than the trainer (the
status's ``use_rate``, groups per minute it trains), each worker waits after a batch so that it samples at
``duty`` of its speed, the same share for every worker, instead of filling the whole want at once and pausing
until the trainer drained it (the want still caps what it samples). Stdlib only.
"""

from __future__ import annotations

import math

ALPHA = 0.3
"""Weight of the newest batch in the rate's moving average."""
LAND_FRACTION = 0.25
"""Largest share of the window's time (``(staleness_bound + 1) x step_s``) one batch may take."""
HEADROOM = 1.0
"""The fleet is paced to this multiple of the trainer's ``use_rate`` (1: that rate, which already errs high: the
step time it comes from leaves out the intake; a bench with 1.25 wasted more, docs/fleet.md)."""
MIN_DUTY = 0.05
"""Smallest share of its speed a worker is paced to: a forged tiny ``use_rate`` slows it, never stops it."""
PROBE_DIVISOR = 4
"""A worker's first batch (its speed not measured yet) holds its groups in flight over this (at least 1)."""
MIN_FRACTION = 0.1
"""Smallest share of the want a worker draws, as a fraction of the count-based share ``want / workers``: a forged
or wrong ``fleet_rate`` (say 1e8) slows honest workers, never stops them."""


class RateMeter:
    """A worker's speed in groups per minute: a moving average (weight ``ALPHA``) of its batches' speeds; batches
    of no groups or no measured time are ignored."""

    def __init__(self) -> None:
        self.rate: float | None = None
        """Groups per minute (None: no batch measured yet)."""

    def add(self, groups: int, seconds: float) -> None:
        """Count one batch.

        Args:
            groups: groups the batch sampled.
            seconds: its seconds, sampling and upload.
        """
        if groups <= 0 or not (math.isfinite(seconds) and seconds > 0):
            return
        now = 60.0 * groups / seconds
        self.rate = now if self.rate is None else ALPHA * now + (1 - ALPHA) * self.rate


def rate_share(wanted: int, workers: int, rate: float, fleet_rate: float, u: float) -> int:
    """A worker's share of ``wanted`` groups by its speed: ``floor(wanted x f + u)`` with ``f = rate / fleet_rate``
    bounded to ``[MIN_FRACTION / workers, 1]`` (a fleet rate below this worker's own: the whole want).

    Args:
        wanted: the groups the trainer wants (>= 0).
        workers: the workers the trainer counts (>= 1).
        rate: this worker's groups per minute (> 0).
        fleet_rate: the fleet's groups per minute as the trainer sums them (> 0).
        u: this worker's draw in ``[0, 1)``.
    """
    f = min(1.0, max(MIN_FRACTION / max(1, workers), rate / fleet_rate))
    return math.floor(wanted * f + u)


def duty(fleet_rate: float | None, use_rate: float | None) -> float:
    """The share of its speed a worker samples at: ``HEADROOM x use_rate / fleet_rate`` in ``[MIN_DUTY, 1]``
    when the fleet is faster than the trainer (1: either rate not known or not positive).

    Args:
        fleet_rate: the fleet's groups per minute (the status's ``fleet_rate``).
        use_rate: the groups per minute the trainer trains (the status's ``use_rate``).
    """
    if fleet_rate is None or use_rate is None or not fleet_rate > 0 or not use_rate > 0:
        return 1.0
    return min(1.0, max(MIN_DUTY, HEADROOM * use_rate / fleet_rate))


def batch_for_rate(k: int, rate: float | None, step_s: float, staleness_bound: int) -> int:
    """Groups a batch may hold so that it lands inside the window: ``k``, or fewer when ``k`` groups at ``rate``
    take longer than ``LAND_FRACTION x (staleness_bound + 1) x step_s`` (at least 1). Before its first batch is
    measured a worker samples a probe of ``k // PROBE_DIVISOR`` groups (at least 1): a slow machine's first batch
    of all its groups in flight could land long after its version left the window.

    Args:
        k: the groups the worker would sample (its groups in flight).
        rate: its groups per minute (None: not measured yet, a probe).
        step_s: the trainer's step seconds (0: not known, no limit).
        staleness_bound: the run's staleness bound.
    """
    if rate is None or not rate > 0:
        return max(1, k // PROBE_DIVISOR)
    if not step_s > 0:
        return k
    fit = rate / 60.0 * LAND_FRACTION * (staleness_bound + 1) * step_s
    return max(1, min(k, math.floor(fit)))
