"""Unicode sparklines and bars for the terminal: ``sparkline([0.1, 0.4, 0.9])`` is ``▁▄█``."""

from __future__ import annotations

import math
from collections.abc import Sequence

BLOCKS = "▁▂▃▄▅▆▇█"
"""The eight heights of a sparkline cell, lowest first."""
GAP = " "
"""The cell of a missing value (None or not finite)."""


def _clean(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def resample(values: Sequence[float | None], width: int) -> list[float | None]:
    """Fit ``values`` into ``width`` cells: each cell is the mean of the finite values that fall into it.

    Args:
        values: the series, oldest first (None or non-finite: missing).
        width: the number of cells (at least 1); a shorter series is returned unchanged.
    """
    if len(values) <= width:
        return list(values)
    out: list[float | None] = []
    for i in range(width):
        part = [c for v in values[i * len(values) // width:(i + 1) * len(values) // width]
                if (c := _clean(v)) is not None]
        out.append(sum(part) / len(part) if part else None)
    return out


def sparkline(values: Sequence[float | None], width: int = 60, lo: float | None = None,
              hi: float | None = None) -> str:
    """One line of block characters, one per value (resampled to at most ``width`` cells).

    Args:
        values: the series, oldest first (None or non-finite: a blank cell).
        width: the most cells.
        lo: the value drawn as the lowest block [default: the series' minimum].
        hi: the value drawn as the highest block [default: the series' maximum].
    """
    cells = [_clean(v) for v in resample(values, max(1, width))]
    finite = [v for v in cells if v is not None]
    if not finite:
        return GAP * len(cells)
    lo = min(finite) if lo is None else lo
    hi = max(finite) if hi is None else hi
    span = hi - lo
    out = []
    for v in cells:
        if v is None:
            out.append(GAP)
            continue
        frac = 0.5 if span <= 0 else min(1.0, max(0.0, (v - lo) / span))
        out.append(BLOCKS[round(frac * (len(BLOCKS) - 1))])
    return "".join(out)


def bar(value: float, top: float, width: int = 30) -> str:
    """A horizontal bar of ``█`` whose length is ``value / top`` of ``width`` (at least one cell when > 0).

    Args:
        value: the quantity.
        top: the quantity drawn at full width.
        width: cells of a full bar.
    """
    if top <= 0 or value <= 0 or not math.isfinite(value):
        return ""
    return "█" * max(1, round(width * min(1.0, value / top)))
