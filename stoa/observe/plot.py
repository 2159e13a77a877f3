"""``stoa plot``: one PNG of a run's curves, read from the bucket alone (matplotlib, the ``plot`` extra).

The figure has one panel per concern (reward, held-out eval, loss, KL, clip/gate fractions, lag, records/s,
workers, see ``stoa.observe.plotdata.PANELS``; the search rate too when a run logged it) against the policy
version or the wall time since each run's first row; other runs of the same bucket can be overlaid, one color
per run. A panel without data says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from stoa.layout import contract_key, metrics_prefix
from stoa.observe.plotdata import Panel, Points, RunCurves, load_run, panels_for

PLOT_HINT = "matplotlib is not installed; pip install 'stoa[plot]'"
STYLES = ("-", "--", ":", "-.")
EMPTY = {"kl": "no data: logged only when kl_beta > 0", "eval": "no data: set eval_every or run stoa eval"}
"""What an empty panel says where the usual reason is a setting, not a missing run."""


class PlotUnavailable(Exception):
    """matplotlib is missing; the message names the extra to install."""



class PanelBox(NamedTuple):
    """Where one panel landed in the PNG, pixels from the top-left corner, and what it drew.

    Args:
        name: the panel's ``Panel.name``.
        left: first column of the axes box.
        top: first row of the axes box.
        right: last column (exclusive).
        bottom: last row (exclusive).
        lines: the data lines drawn (0: the panel says "no data").
    """

    name: str
    left: int
    top: int
    right: int
    bottom: int
    lines: int


class PlotResult(NamedTuple):
    """A written figure.

    Args:
        path: the PNG.
        width: pixels.
        height: pixels.
        panels: every panel's box, in ``panels_for(runs)`` order.
    """

    path: Path
    width: int
    height: int
    panels: list[PanelBox]


def xy(points: Points, x: str, start: float | None) -> tuple[list[float], list[float]]:
    """A curve's x and y lists, sorted by x: the version, or the time since ``start`` (points without a time
    are left out).

    Args:
        points: the curve.
        x: ``version``, ``minutes`` or ``hours``.
        start: the run's first row time (unix seconds).
    """
    if x == "version":
        pairs = [(float(v), y) for v, _, y in points.rows]
    else:
        base, unit = start or 0.0, 3600.0 if x == "hours" else 60.0
        pairs = [((t - base) / unit, y) for _, t, y in points.rows if t is not None]
    pairs.sort(key=lambda p: p[0])
    return [p[0] for p in pairs], [p[1] for p in pairs]


def time_unit(runs: Sequence[RunCurves]) -> str:
    """``hours`` when some run spans more than 3 hours, else ``minutes``.

    Args:
        runs: the runs to draw.
    """
    spans = [t - r.start for r in runs if r.start is not None for p in r.curves.values() for _, t, _ in p.rows
             if t is not None]
    return "hours" if spans and max(spans) > 3 * 3600 else "minutes"


def x_range(runs: Sequence[RunCurves], x: str) -> tuple[float, float] | None:
    """The x range every panel shares: from the smallest to the largest x of any curve of any run, padded (a
    single point gets half a unit each side); None when nothing has data.

    Args:
        runs: the runs to draw.
        x: ``version``, ``minutes`` or ``hours``.
    """
    xs = [v for run in runs for points in run.curves.values() for v in xy(points, x, run.start)[0]]
    if not xs:
        return None
    lo, hi = min(xs), max(xs)
    pad = 0.5 if hi == lo else 0.02 * (hi - lo)
    return lo - pad, hi + pad


def require_matplotlib() -> tuple[Any, Any]:
    """``(Figure, FigureCanvasAgg)``, or PlotUnavailable naming the extra."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PlotUnavailable(PLOT_HINT) from e
    return Figure, FigureCanvasAgg


def draw_panel(ax: Any, panel: Panel, runs: Sequence[RunCurves], x: str,
               xlim: tuple[float, float] | None = None) -> int:
    """Draw one panel's curves of every run (color by run, line style by metric); return the lines drawn.

    Args:
        ax: the matplotlib axes.
        panel: what to draw.
        runs: the runs, the first one in color C0.
        x: ``version``, ``minutes`` or ``hours``.
        xlim: the x range every panel shares (``x_range``); policy versions get whole-number ticks.
    """
    lines, shown = 0, []
    for i, run in enumerate(runs):
        for j, metric in enumerate(panel.metrics):
            points = run.curves.get(metric.key)
            xs, ys = xy(points, x, run.start) if points is not None else ([], [])
            if not xs:
                continue
            ax.plot(xs, ys, color=f"C{i % 10}", linestyle=STYLES[0 if panel.first_only else j % len(STYLES)],
                    drawstyle="steps-post" if metric.key == "workers" else "default", linewidth=1.6,
                    marker="o" if len(xs) < 40 else None, markersize=3)
            lines += 1
            if metric.label not in shown:
                shown.append(metric.label)
            if panel.first_only:
                break
    title = panel.title + (f": {' / '.join(shown)}" if panel.first_only and shown else "")
    ax.set_title(title, fontsize=10)
    if lines == 0:
        ax.text(0.5, 0.5, EMPTY.get(panel.name, "no data"), transform=ax.transAxes, ha="center", va="center",
                color="0.45", fontsize=10)
        ax.set_xticks([])
        ax.set_yticks([])
        return 0
    ax.grid(True, alpha=0.3)
    from matplotlib.ticker import MaxNLocator

    if xlim is not None:
        ax.set_xlim(*xlim)
    if x == "version":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if panel.name == "workers":
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("policy version" if x == "version" else f"wall time ({x})", fontsize=8)
    ax.tick_params(labelsize=8)
    if len(panel.metrics) > 1 and not panel.first_only:
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], color="0.3", linestyle=STYLES[j % len(STYLES)], label=m.label)
                   for j, m in enumerate(panel.metrics)]
        ax.legend(handles=handles, fontsize=7, loc="best")
    return lines


def render(runs: Sequence[RunCurves], out: str | Path, *, x: str = "version", width: int = 1600,
           height: int = 1200, dpi: int = 100) -> PlotResult:
    """Write one PNG of every panel for ``runs`` (the first is the main run, the others overlaid).

    Args:
        runs: the runs' curves (``load_run``).
        out: the PNG path (parent folders are created).
        x: ``version`` or ``time`` (minutes since each run's first row).
        width: figure width in pixels.
        height: figure height in pixels.
        dpi: pixels per inch (font sizes scale with it).
    """
    if x not in ("version", "time"):
        raise ValueError(f"x must be 'version' or 'time', not {x!r}")
    Figure, FigureCanvasAgg = require_matplotlib()
    fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    FigureCanvasAgg(fig)
    cols, panels = 2, panels_for(runs)
    axes = fig.subplots((len(panels) + cols - 1) // cols, cols, squeeze=False).ravel()
    axis = time_unit(runs) if x == "time" else x
    xlim = x_range(runs, axis)
    drawn = [draw_panel(ax, panel, runs, axis, xlim) for ax, panel in zip(axes, panels, strict=False)]
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=f"C{i % 10}", linewidth=2, label=r.run_id) for i, r in enumerate(runs)]
    fig.legend(handles=handles, loc="upper right", ncol=min(len(runs), 4), fontsize=9)
    names = ", ".join(r.run_id for r in runs)
    fig.suptitle(f"stoa run {names}", x=0.02, ha="left", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.965))
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, format="png")
    boxes = []
    for ax, panel, lines in zip(axes, panels, drawn, strict=False):
        b = ax.get_window_extent()
        boxes.append(PanelBox(panel.name, math.ceil(b.x0), math.ceil(height - b.y1), math.floor(b.x1),
                              math.floor(height - b.y0), lines))
    return PlotResult(path, width, height, boxes)


def plot_runs(bucket: Any, run_ids: Sequence[str], out: str | Path, *, x: str = "version", width: int = 1600,
              height: int = 1200) -> PlotResult:
    """Read each run's metrics from ``bucket`` and write one overlaid figure.

    Args:
        bucket: the bucket.
        run_ids: the main run first, then the runs to compare.
        out: the PNG path.
        x: ``version`` or ``time``.
        width: pixels.
        height: pixels.
    """
    require_matplotlib()  # fail before reading the bucket
    return render([load_run(bucket, r) for r in run_ids], out, x=x, width=width, height=height)


def run_known(bucket: Any, run_id: str) -> bool:
    """Whether ``run_id`` has a contract or any metrics object in ``bucket`` (a typo has neither).

    Args:
        bucket: the bucket.
        run_id: the run id.
    """

    return bucket.exists(contract_key(run_id)) or next(iter(bucket.list(metrics_prefix(run_id))), None) is not None
