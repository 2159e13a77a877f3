"""``stoa eval``: the follow-along evaluator, one more bucket client (any machine, torch or MLX engine)."""

from __future__ import annotations

import argparse
import sys

from stoa.config.base import DTYPES
from stoa.config.text import deprecated_flag
from stoa.evaluator import EvalConfig, run_evaluator
from stoa.weights.errors import SyncError

EXIT_WEIGHTS_REFUSED = 10
"""Exit code when the weights to evaluate could not be verified (``EXIT_CODES`` 10)."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``eval`` command.

    Args:
        sub: the top-level subparsers.
    """
    p = sub.add_parser(
        "eval", help="evaluate a run's published versions on its held-out split",
        description="Rebuild a version's weights from the bucket (anchor + patches, verified against the "
                    "pointer), evaluate the task's held-out split (greedy accuracy; multi-turn tasks also EM, "
                    "cover-EM, search rate and pass@k) and write eval/* rows into the run's metrics (source "
                    "'eval'). Each version is evaluated at most once, also after a restart. Without --follow "
                    "the current version is evaluated once.")
    p.add_argument("--bucket", required=True, help="bucket URL or local directory of the run")
    p.add_argument("--run", required=True, help="run id")
    p.add_argument("--follow", action="store_true",
                   help="evaluate every new version until the run finishes, then exit 0")
    p.add_argument("--engine", choices=("auto", "torch", "mlx"), default="auto",
                   help="generation engine [default: auto: MLX on Apple silicon, else torch]")
    p.add_argument("--eval-n", type=int, default=64, help="held-out prompts per evaluation [default: 64]")
    p.add_argument("--eval-k", type=int, default=1,
                   help="multi-turn tasks: sampled episodes per prompt for eval/pass@k [default: 1, greedy only]")
    p.add_argument("--every", type=int, default=1,
                   help="evaluate only versions divisible by this, plus the final one [default: 1]")
    p.add_argument("--max-versions", type=int, default=0,
                   help="stop after this many evaluations [default: 0, no limit]")
    p.add_argument("--backfill", action="store_true",
                   help="a first evaluator starts at the run's first version instead of the current one")
    p.add_argument("--max-new-tokens", type=int, default=0,
                   help="decode cap per answer (per model turn) [default: 0, the run's]")
    p.add_argument("--retriever", default="",
                   help="search tasks: endpoint URL or index directory [default: the run's index in the bucket]")
    p.add_argument("--poll-seconds", type=float, default=2.0, help="wait between looks at the pointer [default: 2]")
    p.add_argument("--wait-seconds", type=float, default=0.0,
                   help="wait this long for the run's contract and model files [default: 0, look once]")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads [default: 0, torch's default]")
    p.add_argument("--device", default="auto", help="torch device [default: auto]")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="compute dtype [default: auto]")
    p.add_argument("--log-dir", default="", help="directory of the local metrics JSONL [default: beside the run]")
    p.add_argument("--report-to", default="", help="trackers the eval rows also go to: wandb, tensorboard (comma "
                                                   "list) [default: none]")
    deprecated_flag(p, "--n", "--eval-n")
    deprecated_flag(p, "--k", "--eval-k")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Evaluate, printing one line per evaluation; a missing run or refused weights is one line and an exit code.

    Args:
        args: parsed arguments.
    """

    cfg = EvalConfig(bucket=args.bucket, run=args.run, follow=args.follow, engine=args.engine, n=args.eval_n,
                     k=args.eval_k, every=args.every, max_versions=args.max_versions, backfill=args.backfill,
                     max_new_tokens=args.max_new_tokens, retriever=args.retriever, poll_seconds=args.poll_seconds,
                     wait_seconds=args.wait_seconds, threads=args.threads, device=args.device, dtype=args.dtype,
                     log_dir=args.log_dir, report_to=args.report_to)
    try:  # a run without a contract raises RunNotFound: exit 12 (stoa.cli.USER_ERRORS)
        summary = run_evaluator(cfg, echo=lambda line: print(line, flush=True))
    except SyncError as e:
        print(f"stoa eval: weights not verified, nothing evaluated with them ({e}); check the trainer's "
              "published objects, or retry once it publishes again", file=sys.stderr)
        return EXIT_WEIGHTS_REFUSED
    if not summary.evaluated and not args.follow:
        print("[eval] the current version is already evaluated; nothing to do")
    return 0
