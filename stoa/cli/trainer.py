"""``stoa trainer``: write the run contract and v1, then learn from whatever rollouts land.

One trainer per run: the trainer holds the run's lease (runs/<run>/trainer/lease.json) and a second one is
refused. On an existing run the contract's settings are used (model, task, n_samples, plane, sampling,
staleness, reuse cap, algorithm): restart with just --bucket and --run; a flag that contradicts the run is an
error showing both values. --steps counts the run's total steps, restarts included.
"""

from __future__ import annotations

import argparse
import os
import warnings

from stoa.config import TrainerConfig, add_config_flags, config_to_toml, load_config, overrides_from_args


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``trainer`` command.

    Args:
        sub: the top-level subparsers.
    """
    p = sub.add_parser("trainer", help="run the trainer", description=__doc__)
    p.add_argument("--config", help="TOML file: flat, or shared with workers (top-level keys plus a "
                                    "[trainer] section); flags override it")
    p.add_argument("--dry-run", action="store_true", help="print the resolved configuration and exit")
    p.add_argument("--take-over", action="store_true",
                   help="take the run from a trainer whose lease heartbeat is older than lease_ttl_seconds "
                        "(a crashed or unreachable one); a live one is never taken over")
    add_config_flags(p, TrainerConfig)
    p.set_defaults(func=run)


def given_places(args: argparse.Namespace, overrides: dict) -> dict[str, str]:
    """Field -> where the user set it (flag, ``DRL_*`` variable or TOML key); fields left at defaults are absent.

    Args:
        args: parsed arguments.
        overrides: the flags' values (``overrides_from_args``).
    """
    from stoa.config.loading import env_layer, flag_layer, toml_layer

    with warnings.catch_warnings():  # load_config already warned about deprecated names
        warnings.simplefilter("ignore")
        layers = [toml_layer(TrainerConfig, args.config), env_layer(TrainerConfig, os.environ),
                  flag_layer(TrainerConfig, overrides)]
    return {name: g.place for layer in layers for name, g in layer.items()}


def run(args: argparse.Namespace) -> int:
    """Resolve the config (against the run's contract when the run exists) and run, or print it (``--dry-run``).

    Args:
        args: parsed arguments.
    """
    from stoa.trainer.setup import resume_config

    overrides = overrides_from_args(args, TrainerConfig)
    cfg = load_config(TrainerConfig, toml_path=args.config, overrides=overrides)
    cfg = resume_config(cfg, given_places(args, overrides))
    if args.dry_run:
        print(config_to_toml(cfg), end="")
        algo = cfg.algo_config()
        print("\n# resolved algorithm")
        print("\n".join(f"# {k} = {v!r}" for k, v in sorted(algo.to_dict().items())))
        return 0
    from stoa.trainer.loop import run_trainer

    summary = run_trainer(cfg, take_over=args.take_over)  # LeaseHeld exits 6, LeaseLost 7 (stoa.cli)
    print(f"[trainer] done: the run is at step {summary['step']}, v{summary['version']}")
    return 0
