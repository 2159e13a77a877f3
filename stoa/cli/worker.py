"""``stoa worker``: pull the current policy, sample groups, upload records; safe to kill any time.

--run is required (a flag, run in --config, or STOA_RUN): the worker joins that run of the bucket.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
import warnings

from stoa.bucket import check_bucket_url
from stoa.config import ConfigError, WorkerConfig, add_config_flags, config_to_toml, load_config, overrides_from_args
from stoa.config.loading import env_layer, toml_layer
from stoa.models.registry import resolve_model
from stoa.worker.loop import run_worker
from stoa.worker.tiers import describe_tier


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
                   help="print this machine's memory tier (the memory it is sized from: a CUDA GPU's free "
                        "memory, else RAM; decode batch, groups in flight, BLAS) and exit")
    add_config_flags(p, WorkerConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Resolve the config, check the bucket and the model up front, and run the worker.

    The bucket URL is checked before anything else; ``--model`` takes the trainer's names (``tiny``,
    ``smollm2-135m``, a directory, a hub id).

    Args:
        args: parsed arguments.
    """

    overrides = overrides_from_args(args, WorkerConfig)
    cfg = load_config(WorkerConfig, toml_path=args.config, overrides=overrides)
    check_bucket_url(cfg.bucket)
    if args.print_tier:

        print(describe_tier(n_samples=cfg.n_samples or 8, engine=cfg.engine, device=cfg.device))
        return 0
    require_run(args.config, overrides)
    if args.dry_run:
        print(config_to_toml(cfg), end="")
        return 0
    _await_local_bucket(cfg)
    if cfg.model:

        cfg = dataclasses.replace(cfg, model=str(resolve_model(cfg.model)))

    s = run_worker(cfg)
    print(f"[worker {s['worker_id']}] done: {s['groups']} groups, {s['tokens']} tokens, "
          f"{s['tokens_per_s']:.1f} tok/s, versions {s['versions']}")
    return 0


def require_run(toml_path: str | None, overrides: dict) -> None:
    """Refuse a worker whose run was not given (a flag, a key of ``--config`` or ``STOA_RUN``): it would wait for a
    run named ``default``.

    Args:
        toml_path: the ``--config`` file, if any.
        overrides: the flags' values (``overrides_from_args``).

    Raises:
        ConfigError: (exit 2) no run given.
    """


    if overrides.get("run") is not None:
        return
    with warnings.catch_warnings():  # load_config already warned about deprecated names
        warnings.simplefilter("ignore")
        if "run" in toml_layer(WorkerConfig, toml_path) or "run" in env_layer(WorkerConfig, os.environ):
            return
    raise ConfigError("run", "required: name the trainer's run with --run NAME (stoa runs --bucket B lists "
                             "them), or set run in --config or STOA_RUN")


def _await_local_bucket(cfg: WorkerConfig) -> None:
    """A local bucket directory that does not exist yet: say so at once, never create it (the trainer
    does), and wait for it up to ``wait_seconds``.

    Args:
        cfg: the worker's settings.

    Raises:
        BucketURLError: the directory still does not exist after ``wait_seconds``.
    """


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
