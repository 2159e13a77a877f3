"""``stoa trainer``: write the run contract and v1, then learn from whatever rollouts land."""

from __future__ import annotations

import argparse

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
    add_config_flags(p, TrainerConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Resolve the config and run (or print it with ``--dry-run``).

    Args:
        args: parsed arguments.
    """
    overrides = overrides_from_args(args, TrainerConfig)
    cfg = load_config(TrainerConfig, toml_path=args.config, overrides=overrides)
    if args.dry_run:
        print(config_to_toml(cfg), end="")
        algo = cfg.algo_config()
        print("\n# resolved algorithm")
        print("\n".join(f"# {k} = {v!r}" for k, v in sorted(algo.to_dict().items())))
        return 0
    from stoa.trainer.loop import run_trainer

    summary = run_trainer(cfg)
    print(f"[trainer] done: {summary['step']} steps, now at v{summary['version']}")
    return 0
