"""Command line of ``stoa bench pulse``: its flags, the learning rates, and the run over every lr."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from stoa.bucket import open_bucket
from stoa.config.text import deprecated_flag
from stoa.models import resolve_model
from stoa.weights.planes import PLANES

from .adapter import bench_adapter, lora_lines
from .report import report_lines
from .sampler import Sampler
from .sweep import bench_lr

DEFAULT_LRS = "1e-6,1e-5"
INITS = ("checkpoint", "bf16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``stoa bench pulse`` flags to ``parser``.

    Args:
        parser: the (sub)command parser.
    """
    parser.add_argument("--model", default="smollm2-135m",
                        help="model name or directory (default smollm2-135m)")
    parser.add_argument("--steps", type=int, default=5,
                        help="AdamW steps (published versions) per lr (default 5)")
    parser.add_argument(
        "--lr",
        action="append",
        default=None,
        metavar="LR",
        help=f"learning rate; repeat the flag or give a comma list (default {DEFAULT_LRS}). Every lr runs "
        "from the same initial weights and samples; the final summary line is for the FIRST lr given",
    )
    parser.add_argument("--plane", choices=PLANES, default="bf16", help="weight plane (default bf16)")
    parser.add_argument("--out", default=None, metavar="FILE.jsonl",
                        help="write one JSON row per step and a summary per lr")
    parser.add_argument("--bucket", default=None, metavar="DIR",
                        help="local bucket directory (default: a temp dir, deleted after)")
    parser.add_argument("--seed", type=int, default=0, help="seed for sampling and advantages (default 0)")
    parser.add_argument("--n-samples", dest="samples", metavar="N", type=int, default=4,
                        help="completions per prompt (default 4; 4 prompts)")
    deprecated_flag(parser, "--samples", "--n-samples")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="completion length cap (default 16)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="timed repeats per measurement, median taken (default 3)")
    parser.add_argument(
        "--init",
        choices=INITS,
        default="checkpoint",
        help="master weights at step 0: 'checkpoint' (default) as the trainer loads them; 'bf16' rounds them "
        "to bf16 first, as when the checkpoint is stored in bf16 (a diagnostic, see docs/weights.md)",
    )
    parser.add_argument("--lora-rank", type=int, default=0, metavar="R",
                        help="compare a rank-R LoRA run's adapter plane with its merged bf16 patch instead (bytes "
                        "synced per version; default 0: the full-weight benchmark)")
    parser.add_argument("--lora-alpha", type=float, default=0.0, metavar="A",
                        help="LoRA alpha with --lora-rank (default 2 x rank)")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch threads for sampling and the training step (default 1: on a shared 2-core machine two "
        "spinning threads are slower); PULSE encode/apply use their own threads",
    )


def parse_lrs(values: Sequence[str] | None) -> list[float]:
    """Learning rates from repeated ``--lr`` flags and/or comma lists, in the order given.

    Args:
        values: the raw flag values (None: the default ``1e-6,1e-5``).
    """
    out: list[float] = []
    for v in values or [DEFAULT_LRS]:
        for part in v.split(","):
            if part.strip():
                lr = float(part)
                if not lr > 0:
                    raise ValueError(f"learning rates must be > 0, got {part!r}")
                out.append(lr)
    if not out:
        raise ValueError("no learning rate given")
    return out



def main(args: argparse.Namespace) -> int:
    """Run the benchmark for every lr, print the table and end with the summary line of the first lr.

    Returns 0 when every path of every lr was bit-identical, else 1.

    Args:
        args: flags from :func:`add_arguments`.
    """
    import torch


    lrs = parse_lrs(args.lr)
    if args.steps < 1 or args.repeat < 1 or args.samples < 2 or args.torch_threads < 1:
        raise ValueError("need --steps >= 1, --repeat >= 1, --samples >= 2 and --torch-threads >= 1")
    echo: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    model_dir = resolve_model(args.model)
    sampler = Sampler(model_dir, args.samples, args.max_new_tokens, args.seed)
    out = open(args.out, "w", encoding="utf-8") if args.out else None  # noqa: SIM115
    tmp = None if args.bucket else tempfile.mkdtemp(prefix="stoa-bench-pulse-")
    bucket = open_bucket(args.bucket or str(tmp))
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.torch_threads)
    try:
        if args.lora_rank > 0:
            lora = [bench_adapter(lr, args, model_dir, bucket, sampler, _writer(out), echo) for lr in lrs]
            print("\n".join(lora_lines(lora)))
            return 0 if all(s["bit_identical"] for s in lora) else 1
        summaries = []
        for lr in lrs:
            echo(f"[bench pulse] {args.model} plane {args.plane} lr {lr:g}: {args.steps} steps")
            summaries.append(bench_lr(lr, args, model_dir, bucket, sampler, _writer(out), echo))
    finally:
        torch.set_num_threads(threads_before)
        if out is not None:
            out.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    for line in report_lines(args, summaries):
        print(line)
    return 0 if all(s["bit_identical"] for s in summaries) else 1


def _writer(out: TextIO | None) -> Callable[[dict[str, Any]], None]:
    """A row sink: one sorted-key JSON line per row to ``out`` (flushed), or nothing when ``out`` is None."""
    def emit(row: dict[str, Any]) -> None:
        if out is not None:
            out.write(json.dumps(row, sort_keys=True) + "\n")
            out.flush()

    return emit
