"""``stoa trainer``: write the run contract and v1, then learn from whatever rollouts land.

--run is required, and --model for a new run. One trainer per run: the trainer holds the run's lease
(runs/<run>/trainer/lease.json) and a second one is refused. A new run stores the trainer's settings
(runs/<run>/config.json, no bucket URL, paths or secrets). On an existing run the settings it was started with
are used (the contract's: model, task, n_samples, plane, sampling, staleness, reuse cap, algorithm; and the
stored ones: lr, groups_per_step, steps, ...): restart with just --bucket and --run. A flag that contradicts
the run is an error showing both values, except steps, checkpoint and eval cadence, trackers, polling and
memory knobs, which change for this trainer (one line lists the changes). --steps counts the run's total
steps, restarts included. --dry-run prints the resolved settings, the checkpoint size and writes per hour,
the bucket cost (requests and storage at R2's prices for --fleet-size workers) and what a restart would change.

Before anything loads, the memory preflight estimates the peak per rank (``stoa.trainer.peak``) and refuses a
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
from typing import TYPE_CHECKING, NamedTuple

from stoa.bucket import check_bucket_url, open_bucket
from stoa.config import ConfigError, TrainerConfig, add_config_flags, config_to_toml, load_config, overrides_from_args
from stoa.config.loading import env_layer, flag_layer, toml_layer
from stoa.config.memory import lora_params
from stoa.layout import contract_key
from stoa.models import default_cache_dir, resolve_model
from stoa.models.registry import SMOLLM2_DIR
from stoa.models.shapes import shape_for, shape_from_dir
from stoa.tasks import get_task, parse_task_spec
from stoa.tasks.multiturn import is_multiturn
from stoa.telemetry.cost import Prices
from stoa.telemetry.costplan import estimate_cost, estimate_lines
from stoa.trainer import peak
from stoa.trainer.cadence import cadence_lines
from stoa.trainer.peak import PromptLength, preflight, prompt_length
from stoa.trainer.setup import resume_plan

if TYPE_CHECKING:
    from stoa.config.memory import FitReport
    from stoa.models.shapes import ModelShape
    from stoa.trainer.peak import PeakEstimate, PromptLength, Workload


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
    p.add_argument("--fleet-size", type=int, default=1, metavar="N",
                   help="workers the --dry-run's bucket-cost estimate assumes (R2 prices, or STOA_PRICE_*) "
                        "[default: 1]")
    add_config_flags(p, TrainerConfig)
    p.set_defaults(func=run)


def given_places(args: argparse.Namespace, overrides: dict) -> dict[str, str]:
    """Field -> where the user set it (flag, ``STOA_*`` variable or TOML key); fields left at defaults are absent.

    Args:
        args: parsed arguments.
        overrides: the flags' values (``overrides_from_args``).
    """

    with warnings.catch_warnings():  # load_config already warned about deprecated names
        warnings.simplefilter("ignore")
        layers = [toml_layer(TrainerConfig, args.config), env_layer(TrainerConfig, os.environ),
                  flag_layer(TrainerConfig, overrides)]
    return {name: g.place for layer in layers for name, g in layer.items()}


def run(args: argparse.Namespace) -> int:
    """Resolve the config (against the run's contract and stored settings when the run exists) and run, or print
    it (``--dry-run``).

    Args:
        args: parsed arguments.
    """

    overrides = overrides_from_args(args, TrainerConfig)
    cfg = load_config(TrainerConfig, toml_path=args.config, overrides=overrides)
    if int(os.environ.get("RANK", "0") or 0) > 0 and not args.dry_run:
        return _follow(cfg, args)
    given = given_places(args, overrides)
    require_run_and_model(cfg, given)
    plan = resume_plan(cfg, given)
    cfg = plan.cfg
    report = memory_report(cfg, args.nproc, args.prompt_tokens, offline=args.dry_run)
    if args.dry_run:
        print(config_to_toml(cfg), end="")
        algo = cfg.algo_config()
        print("\n# resolved algorithm")
        print("\n".join(f"# {k} = {v!r}" for k, v in sorted(algo.to_dict().items())))
        print("\n" + "\n".join(memory_lines(report)))
        print("\n" + "\n".join(_checkpoint_lines(cfg)))
        print("\n".join(_cost_lines(cfg, args.fleet_size)))
        print("\n".join(f"# {line}" for line in plan.notes() or [f"[trainer] run {cfg.run!r} is new"]))
    check_memory(cfg, report)
    if args.dry_run:
        return 0
    for line in plan.notes():
        print(line)
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        argv = torchrun_argv(sys.argv[1:], args.nproc, sys.executable)
        os.execvp(argv[0], argv)  # noqa: S606 (the same command, under torchrun)
    from stoa.trainer.loop import run_trainer

    summary = run_trainer(cfg, take_over=args.take_over)  # LeaseHeld exits 6, LeaseLost 7 (stoa.cli)
    print(f"[trainer] done: the run is at step {summary['step']}, v{summary['version']}")
    return 0


def require_run_and_model(cfg: TrainerConfig, given: dict[str, str]) -> None:
    """Refuse a trainer without ``--run``, and one without ``--model`` unless the run exists (it resumes).

    "Given" is a flag, a key of ``--config`` or an environment variable (``STOA_RUN``). A local bucket that does
    not exist yet holds no run; nothing is created before the check.

    Args:
        cfg: the config from defaults, TOML, env and flags.
        given: ``given_places``'s.

    Raises:
        ConfigError: (exit 2) the run, or the model of a new run, was not given.
        UnknownModel: (exit 2) the given model cannot exist (``model_shape``).
    """

    if "run" not in given:
        raise ConfigError("run", "required: name the run with --run NAME (a new run is created, an existing one "
                                 "resumes), or set run in --config or STOA_RUN")
    if "model" in given:
        model_shape(cfg.model, offline=True)  # an unknown name or a missing directory fails here, before the bucket
        return
    where = check_bucket_url(cfg.bucket)
    local = where.scheme == "file" and not Path(where.location).expanduser().is_dir()
    if local or not open_bucket(cfg.bucket).exists(contract_key(cfg.run)):
        raise ConfigError("model", f"required for a new run ({cfg.run!r} is not in {cfg.bucket}): pass --model "
                                   "(tiny, smollm2-135m, a local directory or a hub id); check --bucket and --run "
                                   "if you meant to resume")


def _checkpoint_lines(cfg: TrainerConfig) -> list[str]:
    """The dry run's checkpoint section, from the model's parameter count when its shape is known here."""

    shape = model_shape(cfg.model, offline=True).shape
    if shape is not None and cfg.lora_rank:  # a LoRA checkpoint holds the adapter and its AdamW moments
        return cadence_lines(cfg, lora_params(shape, cfg.lora_rank, [t.strip() for t in cfg.lora_targets.split(",")]))
    return cadence_lines(cfg, shape.params() if shape is not None else None)


def _cost_lines(cfg: TrainerConfig, fleet: int) -> list[str]:
    """The dry run's bucket-cost section (``stoa.telemetry.costplan``) for ``fleet`` workers."""
    if fleet < 1:
        raise ConfigError("fleet_size", f"must be >= 1, got {fleet}")
    shape = model_shape(cfg.model, offline=True).shape
    adapter = (lora_params(shape, cfg.lora_rank, [t.strip() for t in cfg.lora_targets.split(",")])
               if shape is not None and cfg.lora_rank else None)
    return estimate_lines(estimate_cost(cfg, fleet, shape.params() if shape is not None else None,
                                        adapter_params=adapter), Prices.from_env())


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


class ModelAt(NamedTuple):
    """Where a model's files are here and its shape (``model_shape``)."""

    dir: Path | None
    """Its directory (config.json, tokenizer); None: not on this machine."""
    shape: ModelShape | None
    """Its config.json figures; None: unknown here."""


def model_shape(model: str, offline: bool) -> ModelAt:
    """The model's directory and shape; ``offline`` downloads nothing (a dry run).

    Built-in tiny models build locally and a local directory is read, so a name that is not built in, not a
    directory and not a hub id raises at once, as the run would; a hub id (or SmolLM2) not cached here has no
    shape offline.

    Args:
        model: the ``model`` setting.
        offline: download nothing.

    Raises:
        UnknownModel: (exit 2) a model that cannot exist: an unknown bare name or a missing directory.
    """

    local = Path(model).expanduser()
    hub_id = model.count("/") == 1 and not model.startswith(("/", ".", "~")) and not local.exists()
    if not offline or not (hub_id or model == "smollm2-135m"):
        where: Path | None = resolve_model(model)
    elif model == "smollm2-135m":
        cached = default_cache_dir() / "models" / SMOLLM2_DIR
        where = cached if (cached / "config.json").is_file() else None
    else:
        where = _hub_cached(model)
    return ModelAt(where, shape_from_dir(where, model) if where else shape_for(model))


def _hub_cached(model: str) -> Path | None:
    """A hub id's directory in the Hugging Face cache, without downloading; None when it is not there."""
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(model, "tokenizer_config.json")
        return Path(hit).parent if isinstance(hit, str) else None
    except (ImportError, ValueError, OSError):
        return None


def memory_report(cfg: TrainerConfig, nproc: int, prompt_tokens: int, *, offline: bool
                  ) -> FitReport[Workload, PeakEstimate] | None:
    """The memory preflight of ``cfg`` for its ranks (``world_size``); None when the model's shape is unknown offline.

    Args:
        cfg: the resolved config.
        nproc: ``--nproc`` (0: not given).
        prompt_tokens: ``--prompt-tokens`` (0: the longest held-out prompt, rendered).
        offline: download nothing (a dry run); the shape and tokenizer then come from what is here.
    """

    world = world_size(nproc, os.environ)
    model_dir, shape = model_shape(cfg.model, offline)
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
    cuda = peak.is_cuda(cfg.device)
    base = peak.workload(cfg, prompt.tokens, completion, world, cuda, peak.computes_bf16(cfg.dtype, cuda))
    budget = peak.device_budget(cfg, int(os.environ.get("LOCAL_WORLD_SIZE") or world))
    return peak.fit(cfg, shape, base, budget, max_world=max(world, _devices(cuda)))


def _prompt_length(task: object, model_dir: Path | None, given: int) -> PromptLength:
    """``--prompt-tokens`` when given, else the longest held-out prompt rendered, else a guess."""

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


def memory_lines(report: FitReport[Workload, PeakEstimate] | None) -> list[str]:
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
                 f"({report.source}): {'fits' if report.fits else 'does not fit'}")
    return lines


def check_memory(cfg: TrainerConfig, report: FitReport[Workload, PeakEstimate] | None) -> None:
    """Refuse (``MemoryPreflightError``, exit 2) when the estimate does not fit and ``preflight`` is on; warn when off.

    Args:
        cfg: the resolved config.
        report: ``memory_report``'s (None: unknown, nothing to check).
    """

    if report is None:
        return
    if not report.fits and not cfg.preflight:
        print(f"[trainer] preflight off: {report.message()}", file=sys.stderr)
    preflight(cfg, report)
