"""``stoa status``: one screen of a run read from its bucket alone (state, version, trainer, curves, workers)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from stoa.bucket import BucketError, open_bucket
from stoa.observe.snapshot import ChunkCache, dumps, take_snapshot
from stoa.observe.status import render
from stoa.telemetry.cost import Prices

CLEAR = "\x1b[H\x1b[2J"
"""Home the cursor and clear the terminal (only written to a terminal)."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``status`` command.

    Args:
        sub: the top-level subparsers.
    """
    p = sub.add_parser(
        "status", help="show a run's state, curves and workers from its bucket",
        description="Read a run's status, pointer, trainer lease, journal and metrics chunks from the bucket "
                    "(any machine with its URL and credentials) and print one screen: state, version and its "
                    "age, trainer, steps/min, reward and eval sparklines, records/s, lag, rejections, the workers "
                    "of the last minutes, bucket size by prefix, the run's cost at bucket prices (R2's by default; "
                    "--price-*). One status costs one LIST per 1,000 objects of "
                    "the run plus a few GETs; --watch fetches only new metrics chunks.")
    p.add_argument("--bucket", required=True, help="bucket URL or local directory of the run")
    p.add_argument("--run", required=True, help="run id")
    p.add_argument("--watch", nargs="?", type=float, const=10.0, default=None, metavar="SECONDS",
                   help="redraw every SECONDS until Ctrl-C [default when given: 10]")
    p.add_argument("--json", action="store_true", help="print one JSON object (one per redraw with --watch)")
    p.add_argument("--workers-minutes", type=float, default=10.0, metavar="N",
                   help="show the workers seen in the last N minutes [default: 10]")
    p.add_argument("--max-chunks", type=int, default=50, metavar="K",
                   help="read at most the newest K trainer metrics chunks (curves cover their steps) [default: 50]")
    p.add_argument("--width", type=int, default=60, help="sparkline cells [default: 60]")
    p.add_argument("--price-class-a", type=float, default=None, metavar="USD",
                   help="USD per million class-A requests (PUT, LIST) [default: STOA_PRICE_CLASS_A, else R2's 4.50]")
    p.add_argument("--price-class-b", type=float, default=None, metavar="USD",
                   help="USD per million class-B requests (GET, HEAD) [default: STOA_PRICE_CLASS_B, else R2's 0.36]")
    p.add_argument("--price-storage", type=float, default=None, metavar="USD",
                   help="USD per GB-month stored [default: STOA_PRICE_STORAGE_GB_MONTH, else R2's 0.015]")
    p.set_defaults(func=run)


def status_prices(args: argparse.Namespace) -> Prices:
    """The prices of the cost lines: the ``--price-*`` flags over ``Prices.from_env()`` (R2's by default)."""
    base = Prices.from_env()
    given = {name: v for name, flag in (("class_a_per_million", "price_class_a"),
                                        ("class_b_per_million", "price_class_b"),
                                        ("storage_per_gb_month", "price_storage"))
             if (v := getattr(args, flag, None)) is not None}
    return dataclasses.replace(base, **given)


def run(args: argparse.Namespace) -> int:
    """Print the status once, or redraw it every ``--watch`` seconds until Ctrl-C (exit 0).

    Args:
        args: parsed arguments.

    Raises:
        RunNotFound: nothing is stored under the run (exit 12, ``stoa.cli.USER_ERRORS``).
    """

    if args.watch is not None and args.watch <= 0 or args.workers_minutes <= 0 or args.max_chunks < 1:
        print("stoa status: --watch and --workers-minutes must be > 0 and --max-chunks >= 1", file=sys.stderr)
        return 2
    prices = status_prices(args)
    bucket = open_bucket(args.bucket, create=False)
    cache: ChunkCache = {}
    clear = args.watch is not None and not args.json and sys.stdout.isatty()
    try:
        while True:
            try:
                snap = take_snapshot(bucket, args.run, workers_minutes=args.workers_minutes,
                                     max_trainer_chunks=args.max_chunks, cache=cache, prices=prices)
            except BucketError as e:
                if args.watch is None:
                    raise
                print(f"stoa status: bucket error {e}; trying again in {args.watch:g}s", file=sys.stderr)
                time.sleep(args.watch)
                continue
            text = dumps(snap) if args.json else render(snap, args.width)
            print((CLEAR if clear else "") + text, flush=True)
            if args.watch is None:
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        print("stoa status: stopped watching", file=sys.stderr)
        return 0
