"""``stoa join``: check this machine against a join card, then start a worker (or install it as a service)."""

from __future__ import annotations

import argparse
import sys

from stoa.join.card import CardError
from stoa.join.launch import JoinOptions, join
from stoa.join.service import ServiceError

EXIT_REFUSED = 2
"""Exit code of a bad card, platform or service command (``EXIT_CODES`` in stoa.cli); a failed check exits with
the code of its kind (3 contract, 4 bucket, 5 retriever, 9 credentials)."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``join`` command (its card comes from ``stoa join-card``, registered by ``stoa.cli.join_card``).

    Args:
        sub: the top-level subparsers.
    """
    p = sub.add_parser(
        "join", help="join a run from this machine with a join card",
        description="Check this machine (engine, BLAS on Linux MLX, memory tier and decode batch, free disk, "
                    "bucket reachable, contract compatible, retriever), one line per check; refuse with the fix "
                    "when one fails; then start a worker (stoa worker) in this process, or with "
                    "--install-service write and load a launchd agent (macOS) or systemd user unit (Linux) that "
                    "restarts it on failure and at login.")
    p.add_argument("--card", required=True, metavar="FILE", help="the join card (stoa join-card --out FILE)")
    p.add_argument("--env", default="", metavar="FILE",
                   help="0600 env file with the bucket credentials (stoa join-card --with-secrets) [default: the "
                        "environment]")
    p.add_argument("--name", default="", metavar="LABEL", help="worker label in record keys [default: host name]")
    p.add_argument("--worker-key", default="", metavar="FILE",
                   help="this worker's key file (0600, from the operator: stoa worker-key issue or stoa join-card "
                        "--worker-key); the worker signs every record with it [default: unsigned records]")
    p.add_argument("--dry-run", action="store_true",
                   help="run the checks and print the worker command (or, with --install-service, the service "
                        "file); start nothing")
    p.add_argument("--install-service", action="store_true",
                   help="write and load a launchd agent (macOS) or systemd user unit (Linux) running the worker")
    p.add_argument("--uninstall", action="store_true", help="stop and remove the service of the card's run")
    p.add_argument("--install-task-code", action="store_true",
                   help="when this machine lacks the run's task plugin (the card's task code), pip install the "
                        "versions the trainer ran, then check again")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Join (see ``stoa.join.launch.join``).

    Args:
        args: parsed arguments.
    """

    opts = JoinOptions(card=args.card, env_file=args.env, name=args.name, dry_run=args.dry_run,
                       install=args.install_service, uninstall=args.uninstall,
                       install_task_code=args.install_task_code, worker_key=args.worker_key)
    try:
        return join(opts)
    except (CardError, ServiceError) as e:
        print(f"stoa join: {e}", file=sys.stderr)
        return EXIT_REFUSED
