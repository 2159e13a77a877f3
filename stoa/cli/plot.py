"""``stoa plot``: one PNG of a run's curves (and other runs overlaid), from the bucket alone."""

from __future__ import annotations

import argparse
import re
import sys

from stoa.bucket import open_bucket
from stoa.contract import RunNotFound
from stoa.observe.plot import PlotUnavailable, plot_runs, require_matplotlib, run_known

EXIT_PLOT_USAGE = 2
"""Exit code when matplotlib is missing or the size is malformed (``EXIT_CODES`` 2); an unknown run is
``RunNotFound`` (12)."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``plot`` command.

    Args:
        sub: the top-level subparsers.
    """
    p = sub.add_parser(
        "plot", help="write a PNG of a run's curves (reward, eval, KL, clip/gate, lag, records/s, workers)",
        description="Read a run's metrics chunks from the bucket and write one figure with a panel per curve: "
                    "rollout reward, held-out eval (accuracy, or cover-EM for search tasks), loss, KL, clip/gate "
                    "fractions, lag, records/s and the workers sampling each version. Needs matplotlib "
                    "(pip install 'stoa[plot]'). Works on a live run too: run it again for a fresh picture.")
    p.add_argument("out", metavar="OUT.png", help="the PNG to write")
    p.add_argument("--bucket", required=True, help="bucket URL or local directory of the run")
    p.add_argument("--run", required=True, help="run id")
    p.add_argument("--compare", metavar="RUN", action="append", default=[],
                   help="another run of the same bucket to overlay in its own color (repeatable; or RUN2,RUN3)")
    p.add_argument("--x", choices=("version", "time"), default="version",
                   help="x axis: the policy version, or the wall time since each run's first metrics row "
                        "(minutes; hours past 3 h) [default: version]")
    p.add_argument("--size", default="1600x1200", metavar="WxH", help="figure size in pixels [default: 1600x1200]")
    p.set_defaults(func=run)


def parse_size(text: str) -> tuple[int, int] | None:
    """``WxH`` as ``(width, height)`` pixels, each 200..10000; None when malformed.

    Args:
        text: e.g. ``1600x1200``.
    """
    m = re.fullmatch(r"(\d{3,5})x(\d{3,5})", text.strip())
    if m is None:
        return None
    w, h = int(m.group(1)), int(m.group(2))
    return (w, h) if 200 <= w <= 10000 and 200 <= h <= 10000 else None


def run(args: argparse.Namespace) -> int:
    """Write the figure and print where it is.

    Args:
        args: parsed arguments.
    """

    try:
        require_matplotlib()
    except PlotUnavailable as e:
        print(f"stoa plot: {e}", file=sys.stderr)
        return EXIT_PLOT_USAGE
    size = parse_size(args.size)
    if size is None:
        print(f"stoa plot: --size {args.size!r} is not WxH pixels between 200 and 10000, e.g. --size 1600x1200",
              file=sys.stderr)
        return EXIT_PLOT_USAGE
    bucket = open_bucket(args.bucket, create=False)
    runs = list(dict.fromkeys([args.run, *(r for arg in args.compare for r in arg.split(",") if r)]))
    unknown = [r for r in runs if not run_known(bucket, r)]
    if unknown:
        raise RunNotFound(f"no run {', '.join(map(repr, unknown))} in bucket {bucket.url} (neither a contract nor "
                          "metrics); check --bucket, --run and --compare")
    result = plot_runs(bucket, runs, args.out, x=args.x, width=size[0], height=size[1])
    empty = [p.name for p in result.panels if p.lines == 0]
    note = f"; no data yet for {', '.join(empty)}" if empty else ""
    print(f"[plot] wrote {result.path} ({result.width}x{result.height} px, runs {', '.join(runs)}, "
          f"x = {args.x}){note}")
    return 0
