"""``stoa audit``: every trained group's worker, version, lag, verdicts and step, from the run's bucket (logic in
stoa.observe.audit). An unknown run is ``RunNotFound`` (12)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stoa.bucket import open_bucket
from stoa.observe.audit import footer, read_audit, render


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``audit`` command.

    Args:
        sub: the top-level subparsers.
    """
    p = sub.add_parser(
        "audit", help="show which worker's records each step trained on, with the trainer's verdicts",
        description="Read the trainer's per-step provenance (runs/RUN/trainer/provenance/) and show, for every "
                    "group a step trained on: the step, the worker, the policy version it sampled with and its "
                    "lag, the replay verdict (tool calls re-run), the recompute verdict and residual (lag-0 "
                    "groups: the largest sample median exp|recorded - recomputed| - 1), the signature verdict "
                    "and the record. Lines that do not parse are skipped and counted. Costs one LIST per 1,000 "
                    "steps and one GET per step read.")
    p.add_argument("--bucket", required=True, help="bucket URL or local directory of the run")
    p.add_argument("--run", required=True, help="run id")
    p.add_argument("--step", type=int, default=None, metavar="S", help="only step S [default: every step]")
    p.add_argument("--jsonl", action="store_true", help="one JSON object per group instead of the table")
    p.add_argument("--out", default=None, metavar="FILE", help="write to FILE instead of stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print (or write to ``--out``) the audit of the run.

    Args:
        args: parsed arguments.

    Raises:
        RunNotFound: nothing is stored under the run (exit 12, ``stoa.cli.USER_ERRORS``).
    """
    if args.step is not None and args.step < 1:
        print("stoa audit: --step must be >= 1 (the first step is 1)", file=sys.stderr)
        return 2
    audit = read_audit(open_bucket(args.bucket, create=False), args.run, args.step)
    text = "".join(r.line() + "\n" for r in audit.rows) if args.jsonl else render(audit) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
    if args.jsonl or args.out is not None:
        print(f"stoa audit: {footer(audit)}", file=sys.stderr)
    return 0
