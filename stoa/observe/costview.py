"""The cost lines of ``stoa status``: the run's bucket requests and storage at bucket prices.

The trainer's newest ``cost/*`` row gives its own requests and the workers' as their records reported them;
a worker's newest metrics chunk (already read for the workers table, never fetched for this) may be fresher,
so per class the larger of the two worker figures counts. Storage is the run's listed bytes. Everything
read is untrusted: a value that is not a finite number >= 0 reads as 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from stoa.bucket.meter import Counts
from stoa.telemetry.cost import PRICES_SOURCE, Prices, storage_usd

__all__ = ["CostView", "cost_lines", "cost_view"]

_BIG = 1e15


@dataclass(frozen=True)
class CostView:
    """What the run has cost so far (the current trainer process's share of time and steps).

    Attributes:
        requests: requests by class, the trainer's and the workers' together.
        usd: their price.
        steps: steps the trainer process took (0: none yet).
        trained_tokens: tokens it trained on.
        hours: hours it ran.
        stored_bytes: bytes the run stores now.
        storage_usd_per_hour: their price per hour.
        prices: where the prices come from.
    """

    requests: Counts
    usd: float
    steps: int
    trained_tokens: float
    hours: float
    stored_bytes: int
    storage_usd_per_hour: float
    prices: str

    def per(self, what: float) -> float | None:
        """``usd / what`` (None when ``what`` is 0)."""
        return self.usd / what if what > 0 else None


def _n(row: dict[str, Any], key: str) -> float:
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0 or v > _BIG:
        return 0.0
    return float(v)


def _counts(row: dict[str, Any], prefix: str, keys: tuple[str, str, str]) -> Counts:
    return Counts(*(int(_n(row, prefix + k)) for k in keys))


def _latest(rows: Iterable[dict[str, Any]], key: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for r in rows:
        if key in r:
            found = r
    return found


def cost_view(trainer_rows: list[dict[str, Any]], worker_rows: Iterable[list[dict[str, Any]]], stored_bytes: int,
              prices: Prices, source: str = PRICES_SOURCE) -> CostView | None:
    """The run's cost from the trainer's rows and each worker's newest rows (None: no ``cost/*`` row yet).

    Args:
        trainer_rows: the trainer's metrics rows, oldest first.
        worker_rows: per worker, its newest metrics rows read, oldest first.
        stored_bytes: the run's listed bytes.
        prices: the price list.
        source: where the prices come from (shown).
    """
    t = _latest(trainer_rows, "cost/trainer_a")
    if not t:
        return None
    own = _counts(t, "cost/trainer_", ("a", "b", "free"))
    reported = _counts(t, "cost/workers_", ("a", "b", "free"))
    chunks = Counts()
    for rows in worker_rows:
        chunks = chunks + _counts(_latest(rows, "bucket/a"), "bucket/", ("a", "b", "free"))
    workers = Counts(max(reported.a, chunks.a), max(reported.b, chunks.b), max(reported.free, chunks.free))
    total = own + workers
    return CostView(total, prices.requests_usd(total), int(_n(t, "cost/steps")), _n(t, "cost/trained_tokens"),
                    _n(t, "cost/hours"), stored_bytes, storage_usd(stored_bytes, 1.0, prices), source)


def _usd(v: float | None) -> str:
    if v is None:
        return "-"
    return f"${v:.4f}" if v >= 0.01 else f"${v:.3g}"


def cost_lines(c: CostView | None, label: int) -> list[str]:
    """The status screen's ``cost`` line (and the storage price per hour).

    Args:
        c: the cost view (None: the trainer has logged no ``cost/*`` row yet).
        label: width of the left column.
    """
    if c is None:
        return [f"{'cost':<{label}}- (no cost/* row from the trainer yet)"]
    r = c.requests
    head = (f"{_usd(c.usd)} in requests: {_usd(c.per(c.steps))}/step, {_usd(c.per(c.trained_tokens))}/trained "
            f"token, {_usd(c.per(c.hours))}/hour | {r.a} class A, {r.b} class B, {r.free} free")
    store = f"{c.stored_bytes / 1e9:.3f} GB stored: {_usd(c.storage_usd_per_hour)}/hour | prices: {c.prices}"
    return [f"{'cost':<{label}}{head}", f"{'':<{label}}{store}"]
