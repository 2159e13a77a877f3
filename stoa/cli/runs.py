"""``stoa runs``: list the runs of a bucket; ``stoa runs rm``: delete one (logic in stoa.observe.runs)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING

from stoa.bucket import open_bucket
from stoa.config.base import ConfigError
from stoa.observe.runs import delete_run, inspect_run, list_runs, printable, refuse_live, render
from stoa.observe.status import size

if TYPE_CHECKING:
    from stoa.bucket import Bucket


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``runs`` command and its ``rm`` subcommand.

    Args:
        sub: the top-level subparsers.
    """
    p = sub.add_parser(
        "runs", help="list the runs of a bucket (stoa runs rm deletes one)",
        description="List every run of a bucket from the bucket alone: id, state (running, finished, failed; "
                    "stale: status says running but no trainer holds the run), published version, age (since "
                    "the trainer last wrote its status), size and objects, model. '?' marks what cannot be "
                    "read. Costs one LIST per 1,000 objects under runs/ plus up to four small GETs per run.")
    p.add_argument("--bucket", default=None, help="bucket URL or local directory (required)")
    p.add_argument("--json", action="store_true", help="print one JSON object per run instead of the table")
    p.set_defaults(func=run_list, parser=p)
    rm = p.add_subparsers(dest="runs_command", metavar="rm").add_parser(
        "rm", help="delete every object of a run",
        description="Delete every object under runs/RUN/ (S3: bulk deletes of 1,000 keys). Asks first on a "
                    "terminal; elsewhere needs --yes. Refuses a run whose trainer lease is live (stop the "
                    "trainer first). Workers still running for the run should be stopped too: they would "
                    "write records again.")
    rm.add_argument("run", metavar="RUN", help="run id (as stoa runs lists it)")
    rm.add_argument("--bucket", default=argparse.SUPPRESS, help="bucket URL or local directory (required)")
    rm.add_argument("--yes", action="store_true", help="delete without asking (needed when stdin is not a "
                                                       "terminal)")
    rm.set_defaults(func=run_rm, parser=rm)


def _bucket(args: argparse.Namespace) -> Bucket:
    """The bucket of ``--bucket`` (argparse's usage error, exit 2, when it is missing)."""

    parser: argparse.ArgumentParser = args.parser
    url: str | None = args.bucket
    if url is None:
        parser.error("the following arguments are required: --bucket")
    return open_bucket(url, create=False)


def run_list(args: argparse.Namespace) -> int:
    """Print the runs of the bucket.

    Args:
        args: parsed arguments.
    """

    listing = list_runs(_bucket(args))
    if args.json:
        for row in listing.runs:
            print(json.dumps(asdict(row), sort_keys=True))
    else:
        print(render(listing))
    return 0


def run_rm(args: argparse.Namespace) -> int:
    """Delete a run after asking (or with ``--yes``).

    Args:
        args: parsed arguments.
    """

    bucket = _bucket(args)
    row = inspect_run(bucket, args.run)
    refuse_live(row)
    what = f"run {printable(row.run)} ({row.objects} objects, {size(row.nbytes)}, state {row.state})"
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError("--yes", f"stdin is not a terminal, so stoa runs rm cannot ask; add --yes to delete "
                                       f"{what}")
        answer = input(f"delete {what} from {bucket.url}? [y/N] ").strip().lower()
        if answer not in ("y", "yes"):
            print(f"kept {what}")
            return 0
    n = delete_run(bucket, args.run)
    print(f"deleted {n} objects of run {printable(row.run)}")
    return 0
