"""What a run costs at bucket prices: R2's price list, the trainer's ``cost/*`` figures, workers' reports.

Every process meters its bucket requests (``stoa.bucket.meter``). A worker writes its cumulative counts into
each record header's ``timings`` (keys ``bucket/a``, ``bucket/b``, ``bucket/free``, ``bucket/written``) and its
metrics rows; the trainer adds the newest report of each worker (:class:`WorkerReports`, untrusted: bounded
and validated) to its own counts in each step's ``cost/*`` row (:func:`cost_row`). Stdlib only.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from stoa.bucket.meter import Counts, RequestMeter

__all__ = ["PRICES_SOURCE", "CostClock", "Prices", "REPORT_KEYS", "WorkerReports", "cost_row", "report", "storage_usd"]

PRICES_SOURCE = "Cloudflare R2 pricing page (developers.cloudflare.com/r2/pricing), Standard storage, as of 2025"
"""Where the default prices come from, and when (the price list as this code's author knew it)."""
HOURS_PER_MONTH = 730.0
"""R2 bills storage per GB-month; a month is 730 hours here."""
GB = 1e9
REPORT_KEYS = ("a", "b", "free", "written")
"""The counts a worker reports, as ``bucket/<key>`` in a record header's ``timings``."""
MAX_REPORTED = 10**12
"""A reported cumulative count above this (or negative, or not a whole number) is ignored."""
MAX_REPORT_STEP = 100_000
"""Most requests one worker report may add over its previous one; the rest is counted in ``clipped``."""
MAX_WORKERS = 100_000
"""Workers whose reports are kept; reports of more workers are counted in ``dropped``."""

_ENV = {"class_a_per_million": "STOA_PRICE_CLASS_A", "class_b_per_million": "STOA_PRICE_CLASS_B",
        "storage_per_gb_month": "STOA_PRICE_STORAGE_GB_MONTH"}


@dataclass(frozen=True)
class Prices:
    """Bucket prices in USD (defaults: R2 Standard storage, see :data:`PRICES_SOURCE`; egress is free).

    Attributes:
        class_a_per_million: per million class-A requests (PUT, LIST, multipart steps, DeleteObjects).
        class_b_per_million: per million class-B requests (GET, HEAD).
        storage_per_gb_month: per GB (1e9 bytes) stored for a month.
        free_per_million: per million requests R2 does not bill (DeleteObject); set it for another store.
    """

    class_a_per_million: float = 4.50
    class_b_per_million: float = 0.36
    storage_per_gb_month: float = 0.015
    free_per_million: float = 0.0

    def __post_init__(self) -> None:
        for name in ("class_a_per_million", "class_b_per_million", "storage_per_gb_month", "free_per_million"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"price {name} must be a finite number >= 0, got {v!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Prices:
        """The defaults with ``STOA_PRICE_CLASS_A``, ``STOA_PRICE_CLASS_B`` and ``STOA_PRICE_STORAGE_GB_MONTH``
        (USD) applied.

        Args:
            env: variables to read (default ``os.environ``).
        """
        env = os.environ if env is None else env
        given: dict[str, float] = {}
        for name, var in _ENV.items():
            raw = env.get(var)
            if raw:
                try:
                    given[name] = float(raw)
                except ValueError:
                    raise ValueError(f"{var} must be a price in USD, got {raw!r}") from None
        return cls(**given)

    def requests_usd(self, c: Counts) -> float:
        """USD of the requests in ``c``."""
        return (c.a * self.class_a_per_million + c.b * self.class_b_per_million
                + c.free * self.free_per_million) / 1e6


def storage_usd(stored_bytes: float, hours: float, prices: Prices) -> float:
    """USD of keeping ``stored_bytes`` for ``hours``.

    Args:
        stored_bytes: bytes stored.
        hours: how long.
        prices: the price list.
    """
    return stored_bytes / GB * prices.storage_per_gb_month * hours / HOURS_PER_MONTH


def report(c: Counts) -> dict[str, float]:
    """A worker's report of its cumulative counts: the ``bucket/*`` keys it adds to a record's ``timings``."""
    return {f"bucket/{k}": float(v) for k, v in c.as_dict().items() if k in REPORT_KEYS}


def _whole(v: object) -> int | None:
    """A reported count: a whole number in [0, MAX_REPORTED], else None."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    if v < 0 or v > MAX_REPORTED or v != int(v):
        return None
    return int(v)


@dataclass
class WorkerReports:
    """The newest cumulative bucket counts each worker reported (untrusted).

    A report is the ``bucket/*`` keys of a record header's ``timings``. A report with a malformed count is
    ignored (``bad``); one that lowers a count is a restarted worker (its earlier total is banked); one that
    adds more than :data:`MAX_REPORT_STEP` requests adds only that many (the rest counts in ``clipped``).
    """

    latest: dict[str, Counts] = field(default_factory=dict)
    banked: Counts = Counts()
    bad: int = 0
    clipped: int = 0
    dropped: int = 0

    def observe(self, worker: str, timings: Mapping[str, float]) -> None:
        """Take the report in a record's ``timings`` (no ``bucket/*`` keys: nothing to take)."""
        if not any(k.startswith("bucket/") for k in timings):
            return
        values = [_whole(timings.get(f"bucket/{k}")) for k in REPORT_KEYS]
        if any(v is None for v in values):
            self.bad += 1
            return
        a, b, free, written = (int(v or 0) for v in values)
        prev = self.latest.get(worker)
        if prev is None and len(self.latest) >= MAX_WORKERS:
            self.dropped += 1
            return
        prev = prev or Counts()
        if a < prev.a or b < prev.b or free < prev.free:  # a restart under the same id
            self.banked, prev = self.banked + prev, Counts()
        da, db, dfree = a - prev.a, b - prev.b, free - prev.free
        over = max(0, da + db + dfree - MAX_REPORT_STEP)
        if over:
            self.clipped += over
            scale = MAX_REPORT_STEP / (da + db + dfree)
            da, db, dfree = int(da * scale), int(db * scale), int(dfree * scale)
        self.latest[worker] = prev + Counts(da, db, dfree, max(0, written - prev.written))

    def total(self) -> Counts:
        """All workers' counts: their newest reports plus the totals of earlier incarnations."""
        out = self.banked
        for c in self.latest.values():
            out = out + c
        return out


def cost_row(own: Counts, workers: Counts, prev_total: Counts, *, trained_tokens: float, hours: float,
             steps: int, prices: Prices) -> dict[str, float]:
    """The ``cost/*`` figures of a trainer step.

    Args:
        own: the trainer process's cumulative counts.
        workers: the workers' reported cumulative counts.
        prev_total: ``own + workers`` at the previous step (the step's requests are the difference).
        trained_tokens: tokens trained on by this trainer so far.
        hours: hours this trainer has run.
        steps: steps this trainer has taken.
        prices: the price list.
    """
    total = own + workers
    step = total - prev_total
    usd = prices.requests_usd(total)
    return {"cost/requests_a": total.a, "cost/requests_b": total.b, "cost/requests_free": total.free,
            "cost/trainer_a": own.a, "cost/trainer_b": own.b, "cost/trainer_free": own.free,
            "cost/workers_a": workers.a, "cost/workers_b": workers.b, "cost/workers_free": workers.free,
            "cost/step_requests_a": step.a, "cost/step_requests_b": step.b, "cost/steps": steps,
            "cost/trained_tokens": trained_tokens, "cost/hours": hours,
            "cost/bytes_written": total.written, "cost/usd": usd, "cost/step_usd": prices.requests_usd(step),
            "cost/usd_per_step": usd / steps if steps else 0.0,
            "cost/usd_per_token": usd / trained_tokens if trained_tokens else 0.0,
            "cost/usd_per_hour": usd / hours if hours > 0 else 0.0}


class CostClock:
    """A trainer's running ``cost/*`` figures: its meter's counts plus the workers' reports, step after step.

    Args:
        meter: the trainer process's meter.
        prices: the price list.
        clock: monotonic clock (tests pass a fake one).
    """

    def __init__(self, meter: RequestMeter, prices: Prices, clock: Callable[[], float] = time.monotonic) -> None:
        self.meter, self.prices, self._clock = meter, prices, clock
        self.started, self.tokens, self.steps, self.prev = clock(), 0.0, 0, Counts()

    def row(self, reports: WorkerReports, step_tokens: float, *, step: bool = True) -> dict[str, float]:
        """The ``cost/*`` figures of the step just taken, which trained on ``step_tokens`` tokens (``step=False``:
        the figures now, e.g. the run's last row, with no step taken)."""
        self.steps, self.tokens = self.steps + int(step), self.tokens + max(0.0, step_tokens)
        own, workers = self.meter.counts(), reports.total()
        row = cost_row(own, workers, self.prev, trained_tokens=self.tokens, steps=self.steps, prices=self.prices,
                       hours=(self._clock() - self.started) / 3600.0)
        self.prev = own + workers
        row.update({"cost/reports_bad": reports.bad, "cost/reports_clipped": reports.clipped})
        return row
