"""``stoa local-e2e``: check this machine's worker path without any trainer (generate, score, upload, read back,
validate)."""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from stoa.bucket import BucketError
from stoa.cli import user_error
from stoa.config import ConfigError, DeprecatedSetting
from stoa.worker.local_e2e import run_local_e2e

SHAPE = (("groups", "--groups", 3, "prompt groups"), ("n_samples", "--n-samples", 4, "completions per group"),
         ("max_new_tokens", "--max-new-tokens", 256, "max new tokens per completion"))
"""The check's shape: field, flag, default, meaning (once also the positionals GROUPS SAMPLES TOKENS)."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``local-e2e`` command.

    Args:
        sub: the top-level subparsers.
    """
    p = sub.add_parser("local-e2e", help="generate, score, upload, read back and validate records locally",
                       description=__doc__)
    for dest, flag, default, meaning in SHAPE:
        p.add_argument(flag, dest=dest, type=int, default=None, help=f"{meaning} [default: {default}]")
        p.add_argument(f"old_{dest}", nargs="?", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--engine", default="auto", choices=["auto", "torch", "mlx"], help="generation engine")
    p.add_argument("--model", default="", help="model name or dir [default: env STOA_MODEL, else tiny]")
    p.add_argument("--bucket", default="", help="bucket URL [default: a temporary local directory]")
    p.add_argument("--task", default="arithmetic", help="task spec [default: arithmetic]")
    p.add_argument("--seed", type=int, default=0, help="seed [default: 0]")
    p.set_defaults(func=run)


def shape(args: argparse.Namespace) -> dict[str, int]:
    """The check's groups, n_samples and max_new_tokens: flags, else the deprecated positionals (warning once),
    else the defaults.

    Args:
        args: parsed arguments.

    Raises:
        ConfigError: a value below 1, or one given both ways.
    """

    out = {}
    for dest, flag, default, _ in SHAPE:
        flag_value, old = getattr(args, dest), getattr(args, f"old_{dest}")
        if old is not None:
            warnings.warn("the positionals GROUPS SAMPLES TOKENS are deprecated: use --groups, --n-samples and "
                          "--max-new-tokens (same meaning)", DeprecatedSetting, stacklevel=2)
            if flag_value is not None:
                raise ConfigError(dest, f"given twice, as {flag} and as a positional; keep {flag}")
        value = flag_value if flag_value is not None else old if old is not None else default
        if value < 1:
            raise ConfigError(dest, f"must be >= 1, got {value}")
        out[dest] = value
    return out


def model_from_env(env: os._Environ[str] | dict[str, str]) -> str:
    """``STOA_MODEL``, else the deprecated ``MODEL`` (warning), else ''.

    Args:
        env: the environment.
    """

    if env.get("STOA_MODEL"):
        return env["STOA_MODEL"]
    if env.get("MODEL"):
        warnings.warn("MODEL is deprecated: use STOA_MODEL (same meaning)", DeprecatedSetting, stacklevel=2)
        return env["MODEL"]
    return ""


def run(args: argparse.Namespace) -> int:
    """Run the check and print its summary.

    Args:
        args: parsed arguments.
    """


    size = shape(args)
    model = args.model or model_from_env(os.environ) or "tiny"
    try:
        summary = run_local_e2e(size["groups"], size["n_samples"], size["max_new_tokens"], engine=args.engine,
                                model=model, bucket_url=args.bucket or None, task=args.task, seed=args.seed)
    except RuntimeError as e:

        if user_error(e) is not None:  # a kind with its own exit code (model fetch, contract, ...)
            raise
        print(f"stoa: local-e2e failed: {e}", file=sys.stderr)
        return 4 if isinstance(e.__cause__, BucketError) else 1
    return 0 if summary["validation"] == "ok" and summary.get("cleaned", True) else 1
