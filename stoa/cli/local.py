"""``stoa local train|smoke|export``: local mode's command line (thin: config, then the loop)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stoa.cli.export import EXIT_EXPORT_REFUSED
from stoa.config import add_config_flags, config_to_toml, overrides_from_args
from stoa.config.local import LocalConfig, load_local_config, resolve_backend
from stoa.config.text import deprecated_flag
from stoa.local.fuse import export_local
from stoa.local.loop import make_backend, run_local
from stoa.local.preflight import episode_tokens, fit
from stoa.local.smoke import SMOKE_MESSAGES, TrainableLeafError, smoke_report
from stoa.models import resolve_model
from stoa.models.hf_dir import ExportError
from stoa.models.registry import KNOWN_MODELS
from stoa.models.shapes import shape_for
from stoa.tasks import load_task
from stoa.tokenize import TextCodec

SMOKE_FIELDS = ("backend", "model", "quant_bits", "quant_group_size", "lora_rank", "lora_alpha", "lora_targets",
                "gradient_checkpointing", "dtype", "device", "threads", "torch_base", "seed")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``local`` command with ``train``, ``smoke`` and ``export``.

    Args:
        sub: the top-level subparsers.
    """
    p = sub.add_parser("local", help="single-process RL on one machine (QLoRA, MLX or torch)",
                       description="One process, one 4-bit base + LoRA model: group rollout and training step.")
    lsub = p.add_subparsers(dest="local_command", metavar="ACTION")
    lsub.required = True
    train = lsub.add_parser("train", help="train LoRA adapters with an RL objective",
                            description="Run a local RL training loop (config file, then flags).")
    train.add_argument("--config", help="TOML file with local settings (flags override it)")
    train.add_argument("--dry-run", action="store_true",
                       help="print the resolved config, algorithm and memory estimate, then exit")
    add_config_flags(train, LocalConfig)
    deprecated_flag(train, "--beta", "--kl-beta")
    train.set_defaults(func=run_train)
    smoke = lsub.add_parser("smoke", help="load the model object, print its report, check only adapters train",
                            description="Build the quantized model with LoRA adapters and report it; exits 1 "
                                        "when a non-adapter leaf is trainable.")
    not_smoke = tuple(f for f in LocalConfig.__dataclass_fields__ if f not in SMOKE_FIELDS)
    add_config_flags(smoke, LocalConfig, skip=not_smoke)
    smoke.set_defaults(func=run_smoke)
    export = lsub.add_parser("export", help="fuse the adapters into the base and write an HF directory",
                             description="Fuse the LoRA adapters of RUN_DIR's latest saved state into the "
                                         "dequantized base and write OUT (config, tokenizer, "
                                         "model.safetensors); the mlx-lm adapter layout goes to OUT/adapters.")
    export.add_argument("run_dir", metavar="RUN_DIR", help="the local run's output_dir")
    export.add_argument("out", metavar="OUT", help="directory to create (must be new or empty)")
    export.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of the fused weights [default: float32]")
    export.set_defaults(func=run_export)


def run_train(args: argparse.Namespace) -> int:
    """Resolve the config and train (or print it with ``--dry-run``).

    Args:
        args: parsed arguments.
    """
    overrides = overrides_from_args(args, LocalConfig)
    cfg = load_local_config(args.config, overrides)
    if args.dry_run:
        return _dry_run(cfg)

    try:
        summary = run_local(cfg)
    except TrainableLeafError as e:
        print(f"stoa local train: {e}", file=sys.stderr)
        return 1
    evals = summary["evals"]
    acc = " -> ".join(f"{e['eval/accuracy']:.3f}" for e in evals) if evals else "not evaluated"
    state = "interrupted, saved" if summary["interrupted"] else "done"
    if summary.get("cold_start"):
        cs = summary["cold_start"]
        acc += f" (cold start loss {cs['loss_first']:.3f} -> {cs['loss_last']:.3f})"
    print(f"[local] {state}: step {summary['step']}/{cfg.steps} in {summary['wall_s']:.0f}s; held-out accuracy "
          f"{acc}; output in {summary['output_dir']}")
    return 0


def check_model_name(name: str) -> None:
    """Refuse, without downloading anything, a model that cannot exist: a bare name that is not built in, or a
    directory that is missing or holds no config.json (a hub id ``ORG/NAME`` is checked when it is fetched).

    Args:
        name: the ``model`` setting.

    Raises:
        UnknownModel: (exit 2) the name or directory, with the names that work.
    """


    hub_id = name.count("/") == 1 and not name.startswith(("/", ".", "~")) and not Path(name).expanduser().exists()
    if name not in KNOWN_MODELS and not hub_id:
        resolve_model(name)  # a local directory is only looked at


def _dry_run(cfg: LocalConfig) -> int:

    check_model_name(cfg.model)
    print(config_to_toml(cfg), end="")
    print(f"\n# backend: {resolve_backend(cfg.backend)}")
    print("# resolved algorithm")
    print("\n".join(f"# {k} = {v!r}" for k, v in sorted(cfg.algo_config().to_dict().items())))
    print(f"# cold start: {_cold_start_line(cfg)}")
    shape = shape_for(cfg.model)
    if shape is None:
        print(f"# memory: no config.json for {cfg.model!r} without downloading it; estimated at train time")
    else:
        total = episode_tokens(load_task(cfg.task))  # a multi-turn row: prompt + the episode's token budget
        print(f"# memory: {fit(cfg, shape, total_tokens=total).message()}")
    return 0


def _cold_start_line(cfg: LocalConfig) -> str:
    """What a new run of ``cfg`` does before its first RL step (``--dry-run``)."""
    if not cfg.cold_start:
        return "none (cold_start = '')"
    source = "built by the task" if cfg.cold_start == "demos" else f"from {cfg.cold_start}"
    return (f"{cfg.cold_start_steps} AdamW steps of {cfg.cold_start_batch} demonstrations (up to "
            f"{cfg.cold_start_examples}, {source}) at lr {cfg.cold_start_lr or cfg.lr:g}, before the first RL step "
            "of a new run")


def run_smoke(args: argparse.Namespace) -> int:
    """Build the model object and print the smoke report; 1 when a non-adapter leaf is trainable.

    Args:
        args: parsed arguments.
    """

    cfg = load_local_config(None, overrides_from_args(args, LocalConfig))
    model_dir = resolve_model(cfg.model)
    backend = make_backend(cfg, model_dir)
    try:
        smoke_report(backend, TextCodec(model_dir).encode_prompt(SMOKE_MESSAGES))
    except TrainableLeafError as e:
        print(f"stoa local smoke: FAILED: {e}", file=sys.stderr)
        return 1
    print("smoke: ok")
    return 0


def run_export(args: argparse.Namespace) -> int:
    """Fuse and write the HF directory; 8 (export refused) with a one-line message naming why.

    Args:
        args: parsed arguments.
    """

    try:
        result = export_local(args.run_dir, args.out, dtype=args.dtype)
    except ExportError as e:
        print(f"stoa local export: {e}", file=sys.stderr)
        return EXIT_EXPORT_REFUSED
    print(f"[export] wrote step {result.step} ({result.fused} adapters fused, {result.dtype}, "
          f"{result.nbytes / 1e6:.1f} MB) to {result.out}; mlx-lm adapters in {result.adapters}, "
          f"PEFT adapter in {result.peft}")
    return 0
