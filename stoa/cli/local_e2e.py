"""``stoa local-e2e [GROUPS SAMPLES TOKENS]``: check this machine's worker path without any trainer."""

from __future__ import annotations

import argparse
import os


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``local-e2e`` command.

    Args:
        sub: the top-level subparsers.
    """
    p = sub.add_parser("local-e2e", help="generate, score, upload, read back and validate records locally",
                       description=__doc__)
    p.add_argument("groups", nargs="?", type=int, default=3, help="prompt groups [default: 3]")
    p.add_argument("samples", nargs="?", type=int, default=4, help="completions per group [default: 4]")
    p.add_argument("tokens", nargs="?", type=int, default=256, help="max new tokens [default: 256]")
    p.add_argument("--engine", default="auto", choices=["auto", "torch", "mlx"], help="generation engine")
    p.add_argument("--model", default=os.environ.get("MODEL", ""),
                   help="model name or dir [default: env MODEL or tiny]")
    p.add_argument("--bucket", default="", help="bucket URL [default: a temporary local directory]")
    p.add_argument("--task", default="arithmetic", help="task spec [default: arithmetic]")
    p.add_argument("--seed", type=int, default=0, help="seed [default: 0]")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the check and print its summary.

    Args:
        args: parsed arguments.
    """
    from stoa.config import ConfigError
    from stoa.worker.local_e2e import run_local_e2e

    for name in ("groups", "samples", "tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(name, "must be >= 1")
    import sys

    from stoa.bucket import BucketError

    try:
        summary = run_local_e2e(args.groups, args.samples, args.tokens, engine=args.engine,
                                model=args.model or None, bucket_url=args.bucket or None, task=args.task,
                                seed=args.seed)
    except RuntimeError as e:
        from stoa.cli import user_error

        if user_error(e) is not None:  # a kind with its own exit code (model fetch, contract, ...)
            raise
        print(f"stoa: local-e2e failed: {e}", file=sys.stderr)
        return 4 if isinstance(e.__cause__, BucketError) else 1
    return 0 if summary["validation"] == "ok" and summary.get("cleaned", True) else 1
