"""``stoa trainer``: write the run contract and v1, then learn from whatever rollouts land.

One trainer per run: the trainer holds the run's lease (runs/<run>/trainer/lease.json) and a second one is
refused. On an existing run the contract's settings are used (model, task, n_samples, plane, sampling,
staleness, reuse cap, algorithm): restart with just --bucket and --run; a flag that contradicts the run is an
error showing both values. --steps counts the run's total steps, restarts included.

Before anything loads, the memory preflight estimates the peak per rank (``stoa.trainer.memory``) and refuses a
run that would not fit, naming the flag that would (--no-preflight only reports). ``--nproc G`` runs G ranks on
this machine under torchrun (FSDP2); for several machines start ``python -m torch.distributed.run --nnodes ...
-m stoa trainer ...`` on each yourself.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from stoa.config import ConfigError, TrainerConfig, add_config_flags, config_to_toml, load_config, overrides_from_args

if TYPE_CHECKING:
    from stoa.trainer.memory import FitReport, PromptLength


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
    p.add_argument("--nproc", type=int, default=0,
                   help="ranks (processes, one GPU each) on this machine: G > 1 re-runs this command under "
                        "torchrun with FSDP2; with --dry-run only the memory estimate is for G ranks "
                        "[default: WORLD_SIZE, else 1]")
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="prompt length for the memory preflight [default: the longest of the task's held-out "
                        "prompts, rendered]")
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
    if int(os.environ.get("RANK", "0") or 0) > 0 and not args.dry_run:
        return _follow(cfg, args)
    cfg = resume_config(cfg, given_places(args, overrides))
    report = memory_report(cfg, args.nproc, args.prompt_tokens, offline=args.dry_run)
    if args.dry_run:
        print(config_to_toml(cfg), end="")
        algo = cfg.algo_config()
        print("\n# resolved algorithm")
        print("\n".join(f"# {k} = {v!r}" for k, v in sorted(algo.to_dict().items())))
        print("\n" + "\n".join(memory_lines(report)))
    check_memory(cfg, report)
    if args.dry_run:
        return 0
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        argv = torchrun_argv(sys.argv[1:], args.nproc, sys.executable)
        os.execvp(argv[0], argv)  # noqa: S606 (the same command, under torchrun)
    from stoa.trainer.loop import run_trainer

    summary = run_trainer(cfg, take_over=args.take_over)  # LeaseHeld exits 6, LeaseLost 7 (stoa.cli)
    print(f"[trainer] done: the run is at step {summary['step']}, v{summary['version']}")
    return 0


def world_size(nproc: int, env: dict[str, str] | os._Environ[str]) -> int:
    """The trainer's ranks: ``--nproc``, else ``WORLD_SIZE`` (under torchrun), else 1.

    Args:
        nproc: the ``--nproc`` value (0: not given).
        env: the environment.
    """
    if nproc < 0:
        raise ConfigError("nproc", f"must be >= 1, got {nproc}")
    return nproc or int(env.get("WORLD_SIZE", "1") or 1)


def torchrun_argv(argv: list[str], nproc: int, python: str) -> list[str]:
    """The command that runs ``stoa <argv>`` as ``nproc`` ranks under torchrun on this machine, without --nproc.

    Args:
        argv: this command's arguments after the program name (``sys.argv[1:]``), global flags included.
        nproc: ranks.
        python: the interpreter (``sys.executable``).
    """
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    # '--': torchrun's own parser would otherwise take a later --run for its --run-path
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m", "stoa",
            "--", *rest]


def _follow(cfg: TrainerConfig, args: argparse.Namespace) -> int:
    """A rank other than 0 under torchrun: rank 0 resolves the run's config (and checks memory) and sends it."""
    from stoa.trainer.loop import run_trainer

    run_trainer(cfg, take_over=args.take_over)
    return 0


def _model_dir(model: str, offline: bool) -> Path | None:
    """The model's directory (config.json, tokenizer) without downloading when ``offline``; None: not here."""
    from stoa.models import KNOWN_MODELS, default_cache_dir, resolve_model

    local = Path(model).expanduser()
    if (local / "config.json").is_file():
        return local
    if not offline or (model in KNOWN_MODELS and model != "smollm2-135m"):  # the tiny models build locally
        return resolve_model(model)
    from stoa.models.registry import SMOLLM2_DIR

    cached = default_cache_dir() / "models" / SMOLLM2_DIR
    if model == "smollm2-135m":
        return cached if (cached / "config.json").is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(model, "tokenizer_config.json")
        return Path(hit).parent if isinstance(hit, str) else None
    except (ImportError, ValueError, OSError):
        return None


def memory_report(cfg: TrainerConfig, nproc: int, prompt_tokens: int, *, offline: bool) -> FitReport | None:
    """The memory preflight of ``cfg`` for its ranks (``world_size``); None when the model's shape is unknown offline.

    Args:
        cfg: the resolved config.
        nproc: ``--nproc`` (0: not given).
        prompt_tokens: ``--prompt-tokens`` (0: the longest held-out prompt, rendered).
        offline: download nothing (a dry run); the shape and tokenizer then come from what is here.
    """
    from stoa.local.shapes import shape_for, shape_from_dir
    from stoa.tasks import get_task, parse_task_spec
    from stoa.tasks.multiturn import is_multiturn
    from stoa.trainer import memory

    world = world_size(nproc, os.environ)
    model_dir = _model_dir(cfg.model, offline)
    shape = shape_from_dir(model_dir, cfg.model) if model_dir else shape_for(cfg.model)
    if shape is None:
        return None
    try:
        name, opts = parse_task_spec(cfg.task)
        task = get_task(name, **opts)
    except (ValueError, OSError):  # task data only the bucket holds (a resumed run)
        task = None
    limits = getattr(task, "limits", None) if task is not None and is_multiturn(task) else None
    completion = int(limits.max_total_tokens) if limits is not None else cfg.max_new_tokens
    prompt = _prompt_length(task, model_dir, prompt_tokens)
    cuda = memory.is_cuda(cfg.device)
    base = memory.workload(cfg, prompt.tokens, completion, world, cuda, memory.computes_bf16(cfg.dtype, cuda))
    budget = memory.device_budget(cfg, int(os.environ.get("LOCAL_WORLD_SIZE") or world))
    return memory.check_fit(cfg, shape, base, budget, max_world=max(world, _devices(cuda)))


def _prompt_length(task: object, model_dir: Path | None, given: int) -> PromptLength:
    """``--prompt-tokens`` when given, else the longest held-out prompt rendered, else a guess."""
    from stoa.trainer.memory import PromptLength, prompt_length

    if given > 0:
        return PromptLength(given, "--prompt-tokens")
    try:
        return prompt_length(task, model_dir if task is not None else None)
    except (ValueError, OSError, KeyError):  # held-out prompts that need data not here
        return prompt_length(None, None)


def _devices(cuda: bool) -> int:
    """Ranks --nproc may name on this machine: its GPUs (CUDA), or 8."""
    if not cuda:
        return 8
    import torch

    return torch.cuda.device_count()


def memory_lines(report: FitReport | None) -> list[str]:
    """The dry run's memory section: each part of the estimated peak per rank in GB, the memory, the verdict.

    Args:
        report: ``memory_report``'s.
    """
    if report is None:
        return ["# memory per rank: unknown (no config.json of the model here; the run checks it after download)"]
    w = report.work
    lines = [f"# estimated peak memory per rank ({w.world_size} rank(s), micro-batch {w.micro_batch}, prompt "
             f"{w.prompt_tokens} + {w.completion_tokens} tokens)"]
    lines += [f"# {k} = {v:.2f} GB" for k, v in report.estimate.parts().items()]
    lines.append(f"# total = {report.estimate.total:.2f} GB of {report.available_gb:.2f} GB per rank "
                 f"({report.budget.source}): {'fits' if report.fits else 'does not fit'}")
    return lines


def check_memory(cfg: TrainerConfig, report: FitReport | None) -> None:
    """Refuse (``MemoryPreflightError``, exit 2) when the estimate does not fit and ``preflight`` is on; warn when off.

    Args:
        cfg: the resolved config.
        report: ``memory_report``'s (None: unknown, nothing to check).
    """
    from stoa.trainer.memory import preflight

    if report is None:
        return
    if not report.fits and not cfg.preflight:
        print(f"[trainer] preflight off: {report.message()}", file=sys.stderr)
    preflight(cfg, report)
