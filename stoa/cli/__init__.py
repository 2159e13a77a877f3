"""The ``stoa`` command line: one module per command, each with ``register(subparsers)``."""

from __future__ import annotations

import argparse
import logging
import os
import sys

COMMANDS = ("trainer", "worker", "quickstart", "model", "bench", "local-e2e", "local", "export")


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every command registered."""
    import importlib

    parser = argparse.ArgumentParser(prog="stoa", description="RL post-training with disposable rollout workers.")
    parser.add_argument("--log-level", default=os.environ.get("STOA_LOG_LEVEL", "WARNING"),
                        help="Python logging level for library messages [default: WARNING]")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"stoa.cli.{name.replace('-', '_')}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``stoa`` script; returns the exit code.

    Args:
        argv: arguments (default ``sys.argv[1:]``).
    """
    from stoa.bucket import BucketError
    from stoa.config import ConfigError
    from stoa.contract import ContractMismatch

    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"stoa: invalid setting {e}", file=sys.stderr)
        return 2
    except ContractMismatch as e:
        print(f"stoa: {e}", file=sys.stderr)
        return 3
    except BucketError as e:
        print(f"stoa: bucket error: {e}", file=sys.stderr)
        return 4
    except TimeoutError as e:
        print(f"stoa: {e}", file=sys.stderr)
        return 5
    except KeyboardInterrupt:
        print("stoa: interrupted", file=sys.stderr)
        return 130
