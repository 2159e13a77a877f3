"""``stoa worker``: pull the current policy, sample groups, upload records; safe to kill any time."""

from __future__ import annotations

import argparse
import dataclasses

from stoa.config import WorkerConfig, add_config_flags, config_to_toml, load_config, overrides_from_args


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``worker`` command.

    Args:
        sub: the top-level subparsers.
    """
    p = sub.add_parser("worker", help="run a rollout worker", description=__doc__)
    p.add_argument("--config", metavar="FILE", help="TOML file: flat, or shared with the trainer (top-level "
                                                    "keys plus a [worker] section); flags override it")
    p.add_argument("--dry-run", action="store_true", help="print the resolved configuration and exit")
    p.add_argument("--print-tier", action="store_true",
                   help="print this machine's memory tier (decode batch, groups in flight, BLAS) and exit")
    add_config_flags(p, WorkerConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Resolve the config, check the bucket and the model up front, and run the worker.

    The bucket URL is checked before anything else; ``--model`` takes the trainer's names (``tiny``,
    ``smollm2-135m``, a directory, a hub id).

    Args:
        args: parsed arguments.
    """
    from stoa.bucket import check_bucket_url

    cfg = load_config(WorkerConfig, toml_path=args.config, overrides=overrides_from_args(args, WorkerConfig))
    check_bucket_url(cfg.bucket)
    if args.print_tier:
        from stoa.worker.tiers import describe_tier

        print(describe_tier(n_samples=cfg.n_samples or 8))
        return 0
    if args.dry_run:
        print(config_to_toml(cfg), end="")
        return 0
    _await_local_bucket(cfg)
    if cfg.model:
        from stoa.models.registry import resolve_model

        cfg = dataclasses.replace(cfg, model=str(resolve_model(cfg.model)))
    from stoa.worker.loop import run_worker

    s = run_worker(cfg)
    print(f"[worker {s['worker_id']}] done: {s['groups']} groups, {s['tokens']} tokens, "
          f"{s['tokens_per_s']:.1f} tok/s, versions {s['versions']}")
    return 0


def _await_local_bucket(cfg: WorkerConfig) -> None:
    """A local bucket directory that does not exist yet: say so at once, never create it (the trainer
    does), and wait for it up to ``wait_seconds``.

    Args:
        cfg: the worker's settings.

    Raises:
        BucketURLError: the directory still does not exist after ``wait_seconds``.
    """
    import os
    import time

    from stoa.bucket import check_bucket_url

    where = check_bucket_url(cfg.bucket)
    path = os.path.abspath(os.path.expanduser(where.location))
    if where.scheme != "file" or os.path.isdir(path):
        return
    print(f"[worker] bucket directory {path} does not exist yet; waiting up to {cfg.wait_seconds:g}s for the "
          f"trainer to create it (check --bucket if no trainer is starting)", flush=True)
    deadline = time.monotonic() + cfg.wait_seconds
    while not os.path.isdir(path) and time.monotonic() < deadline:
        time.sleep(min(cfg.poll_seconds, max(0.0, deadline - time.monotonic())))
    check_bucket_url(cfg.bucket, must_exist=True)
