"""``stoa quickstart``: a local bucket, one trainer and N worker processes, with live progress."""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from stoa.config import ConfigError, TrainerConfig, load_config, parse_scalar
from stoa.layout import checkpoint_files_prefix, logs_prefix, metrics_prefix, run_prefix, weights_prefix
from stoa.models import resolve_model
from stoa.tasks import load_task
from stoa.telemetry.metrics import read_metrics

# Defaults sized for learning per minute on a 2-core CPU with SmolLM2-135M: 30 steps of ~10 s (bf16 trainer,
# groups without signal skipped) reach held-out 0.68 from 0.13 in ~9 min (docs/speed.md); 12 steps reached 0.48.
DEFAULTS = {"model": "smollm2-135m", "task": "arithmetic", "steps": 30, "workers": 2}
DEFAULT_BUCKET = "./stoa-quickstart"
WORKER_EXIT_S = 15.0
"""Seconds the workers get to exit by themselves once the run finished (their current batch, then exit 0)."""
SEARCH_STEPS = 8
"""``--task search``'s default steps: multi-turn steps take minutes here (docs/search.md)."""
PRESETS = {
    # Short completions and small batches: arithmetic answers need few tokens. Held-out evals at steps 0, 10, 20
    # and 30 draw the eval curve (two evals more than before and after).
    "smollm2-135m": {"n_samples": 8, "groups_per_step": 4, "max_new_tokens": 16, "lr": 3e-6, "eval_n": 100,
                     "micro_batch": 16, "kl_beta": 0.0, "eval_every": 10},
    # A random model never solves arithmetic: its groups all score 0, so it trains on them (the loop is the point).
    "tiny": {"n_samples": 4, "groups_per_step": 4, "max_new_tokens": 8, "lr": 1e-3, "eval_n": 16,
             "micro_batch": 16, "skip_uniform_groups": False, "eval_every": 1},
}
SEARCH_PRESETS = {
    # Multi-turn episodes (up to 3 model turns of 48 tokens, ~180-token observations): fewer, longer rows. A
    # 2-step cold start on the task's demonstrations first (135M never completes search -> read -> answer by
    # chance: cover-EM 0.000), which teaches the protocol (0.19), then RL at lr 2e-5 learns the answers (0.65 at
    # step 4, 0.67 at 8). A 4-step cold start reached 0.71 alone and RL at 5e-6 added nothing (docs/search.md).
    # micro_batch 4: the trainer peaked at 8.2 GB of RSS (8 OOM-killed it next to other jobs on 24 GB).
    "smollm2-135m": {"n_samples": 8, "groups_per_step": 4, "max_new_tokens": 48, "lr": 2e-5, "eval_n": 48,
                     "micro_batch": 4, "kl_beta": 0.0, "cold_start": "demos", "cold_start_steps": 2},
    # eval_every: search_eval_every(steps)
    # A random model never finds an answer: every group scores 0, so it trains on them too (as above).
    "tiny": {"n_samples": 4, "groups_per_step": 2, "max_new_tokens": 8, "lr": 1e-3, "eval_n": 4,
             "micro_batch": 8, "skip_uniform_groups": False, "eval_every": 1},
}
LORA_LR = 1e-4
"""The lr of a SmolLM2 quickstart with ``--lora-rank`` (an adapter needs a larger step than full fine-tuning's
3e-6). Measured with rank 16 on arithmetic (docs/memory.md): lr 3e-5 reached 0.42 held-out in 30 steps, 1e-4
reached 0.65, as full fine-tuning does. The search task's LoRA lr is this one too, unmeasured."""
SEARCH_EVALS = 2
"""Held-out evals of a SmolLM2 search quickstart after the ones before RL (``search_eval_every``): with the evals
before and after the cold start, a curve of four points (before, cold start, mid-run, final). Measured on this
2-core CPU: one eval of 48 greedy episodes takes 37 s quiet (71-180 s at load ~8) against 60-140 s per step.
eval_k stays 1: ``--set eval_k_final=8`` adds pass@8 to the cold-start and final evals, and 8 sampled episodes
per prompt took 415 s against the greedy eval's 37 s (the trainer alone, workers waiting for v1)."""
SEARCH_TASKS = {"smollm2-135m": "search:hops=2,max_turns=3,max_total_tokens=640,format_reward=0.1",
                "tiny": "search:entities=60,max_turns=2,max_total_tokens=256"}
"""``--task search`` per model: the built-in search task with two-hop questions (room for RL after the cold start),
sized for this machine (tiny: a small one-hop world, for CI)."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``quickstart`` command.

    Args:
        sub: the top-level subparsers.
    """
    p = sub.add_parser("quickstart", help="run trainer + workers on a local bucket", description=__doc__)
    p.add_argument("--workers", type=int, default=DEFAULTS["workers"], help="worker processes [default: 2]")
    p.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps [default: {DEFAULTS['steps']}; {SEARCH_STEPS} with --task search]")
    p.add_argument("--model", default=DEFAULTS["model"], help="model name or path [default: smollm2-135m]")
    p.add_argument("--task", default=DEFAULTS["task"],
                   help="task spec, e.g. gsm8k or search (multi-turn: a search agent with a BM25 retriever) "
                        "[default: arithmetic]")
    p.add_argument("--bucket", default=None, help=f"local bucket directory [default: {DEFAULT_BUCKET}]")
    p.add_argument("--dir", default=None, help="deprecated spelling of --bucket")
    p.add_argument("--run", default="", help="run id [default: quickstart-<time>]")
    p.add_argument("--algorithm", default="grpo", help="grpo, dr_grpo, dapo, gspo, rloo, cispo, gigpo [default: grpo]")
    p.add_argument("--lora-rank", type=int, default=0, metavar="R",
                   help="train rank-R LoRA adapters on a frozen base instead of every weight (lora_rank; workers "
                        "sample the merged weights; lr 1e-4 on SmolLM2) [default: 0, full fine-tuning]")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any trainer setting, e.g. --set lr=1e-5 (repeatable)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Start the workers, run the trainer in this process, stop the workers, print a summary.

    Args:
        args: parsed arguments.
    """
    from stoa.trainer.loop import run_trainer

    args.bucket = bucket_arg(args.bucket, args.dir)
    if args.workers < 1:
        raise ConfigError("workers", "must be >= 1")
    if args.steps is None:
        args.steps = SEARCH_STEPS if args.task == "search" else DEFAULTS["steps"]
    if args.steps < 1:
        raise ConfigError("steps", "must be >= 1")
    run_id = args.run or time.strftime("quickstart-%Y%m%d-%H%M%S")
    overrides = trainer_settings(args, run_id)
    task = overrides["task"]
    cfg = load_config(TrainerConfig, overrides=overrides, env={})

    load_task(cfg.task)  # a task that cannot be built is one line before anything starts or is written

    print(f"[quickstart] run {run_id} in {Path(args.bucket).resolve()} with {args.workers} workers, "
          f"model {args.model}, task {task}, {args.steps} steps")
    resolve_model(cfg.model)  # fetch/convert once, before workers start
    log_dir = Path(args.bucket) / logs_prefix(run_id)
    log_dir.mkdir(parents=True, exist_ok=True)
    threads, trainer_threads = thread_split(os.cpu_count() or 2, args.workers)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    workers = []
    for i in range(args.workers):
        cmd = [sys.executable, "-m", "stoa", "worker", "--bucket", args.bucket, "--run", run_id,
               "--name", f"qs{i}", "--engine", "torch", "--threads", str(threads), "--wait-seconds", "900"]
        fh = open(log_dir / f"worker{i}.log", "w")  # noqa: SIM115 - closed below
        workers.append((subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env), fh))
    t0 = time.perf_counter()
    import torch

    torch.set_num_threads(trainer_threads)
    grace = 0.0
    try:
        summary = run_trainer(cfg)
        grace = WORKER_EXIT_S  # the run reads finished: the workers exit on their own, their metrics uploaded
    finally:
        wall = time.perf_counter() - t0
        _stop_workers(workers, grace)
    _print_summary(summary, wall, Path(args.bucket), run_id, lora=cfg.lora_rank > 0)
    return 0


def thread_split(cores: int, workers: int) -> tuple[int, int]:
    """Threads per worker process and for the trainer: the workers share the cores, the trainer takes them all.

    The trainer is the quickstart's bottleneck: the workers sample a version's groups, then wait for the next
    version (the staleness bound), and before v1 (the evals, the cold start) they have nothing to do. Measured on
    2 cores (SmolLM2-135M, 2 workers of 1 thread): the search quickstart took 14.0 min with a 2-thread trainer
    against 19.7 min with 1 thread (the same held-out figures within a question; docs/search.md); the arithmetic
    quickstart, whose workers sample more of the time, 5.4 min against 5.6 (median step 7.2 s against 7.9 s).

    Args:
        cores: the machine's cores.
        workers: worker processes.
    """
    return max(1, cores // (workers + 1)), max(1, cores)


def trainer_settings(args: argparse.Namespace, run_id: str) -> dict[str, Any]:
    """The trainer's settings: the model's preset for the task, the run, then every ``--set`` (which wins).

    Args:
        args: parsed arguments (``steps`` already resolved).
        run_id: the run id.
    """
    kind = "tiny" if args.model.startswith("tiny") else "smollm2-135m"
    task = SEARCH_TASKS[kind] if args.task == "search" else args.task
    preset = (SEARCH_PRESETS if task.startswith("search") else PRESETS)[kind]
    overrides = {**preset, "bucket": args.bucket, "run": run_id, "model": args.model, "task": task,
                 "steps": args.steps, "algorithm": args.algorithm, "max_wait_seconds": 900.0}
    if getattr(args, "lora_rank", 0):
        overrides["lora_rank"] = args.lora_rank
        if kind != "tiny":
            overrides["lr"] = LORA_LR
    if task.startswith("search") and kind != "tiny":
        overrides["eval_every"] = search_eval_every(args.steps)
    for item in args.set:
        if "=" not in item:
            raise ConfigError("set", f"expected KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        field, dot, knob = k.strip().replace("-", "_").partition(".")
        if dot:  # algo.KNOB=VALUE: an [algo] knob, as the trainer's --set takes it
            overrides[field] = {**overrides.get(field, {}), knob: parse_scalar(v.strip())}
        else:
            overrides[field] = parse_scalar(v.strip())
    return overrides


def search_eval_every(steps: int) -> int:
    """Steps between the search quickstart's held-out evals: :data:`SEARCH_EVALS` evals spread over the run
    (the last at its final step), besides the one before it.

    Args:
        steps: the run's optimizer steps (>= 1).
    """
    return max(1, math.ceil(steps / SEARCH_EVALS))


def _stop_workers(workers: list[tuple[subprocess.Popen, Any]], grace_s: float) -> None:
    """Give the workers ``grace_s`` to exit by themselves (they do once the run's status says finished, after
    uploading their last metrics chunk), then terminate the rest (a terminated worker's last rows stay local).

    Args:
        workers: each worker process and its log file (closed here).
        grace_s: seconds to wait for all of them before terminating.
    """
    deadline = time.monotonic() + grace_s
    for proc, _ in workers:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
    for proc, fh in workers:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        fh.close()


def bucket_arg(bucket: str | None, old: str | None) -> str:
    """The quickstart's bucket directory from ``--bucket`` or its deprecated spelling ``--dir`` (one warning line).

    Args:
        bucket: ``--bucket``'s value (None: not given).
        old: ``--dir``'s value (None: not given).

    Raises:
        ConfigError: both were given with different values.
    """

    if old is None:
        return bucket or DEFAULT_BUCKET
    if bucket is not None and bucket != old:
        raise ConfigError("bucket", f"--bucket {bucket!r} and --dir {old!r} disagree; give --bucket only")
    print("stoa quickstart: --dir is deprecated, use --bucket (same meaning)", file=sys.stderr)
    return old


def eval_lines(evals: list[dict[str, Any]]) -> list[str]:
    """The summary's held-out lines: before -> after, and with a cold start the three stages side by side
    (before, after the cold start alone, final), with pass@k and the sampled share where the eval sampled.

    Args:
        evals: the trainer's evals in order (``label`` and the figures).
    """
    if not evals:
        return []
    a, b = evals[0], evals[-1]
    out = [f"  held-out acc   before {a['accuracy']:.3f} -> after {b['accuracy']:.3f} ({len(evals)} evals)"]
    stages = [("before", a)] + [("cold start", e) for e in evals if e.get("label") == "cold start"][:1]
    stages += [("final", b)] if b is not a and b.get("label") != "cold start" else []
    kinds = sorted({k for _, e in stages for k in e if k.startswith("cover_em_")})
    for key, name in (("cover_em", "cover-EM"), *((k, f"  {k.removeprefix('cover_em_')}") for k in kinds),
                      ("em", "EM"), ("search_rate", "search rate")):
        if all(key in e for _, e in stages):
            out.append(f"  {name:<14} " + " -> ".join(f"{label} {e[key]:.3f}" for label, e in stages))
    for key in sorted({k for _, e in stages for k in e if k.startswith("pass@")} | {"sampled_accuracy"}):
        have = [(label, e[key]) for label, e in stages if key in e]
        if have:
            name = "sampled acc" if key == "sampled_accuracy" else key
            out.append(f"  {name:<14} " + " -> ".join(f"{label} {v:.3f}" for label, v in have))
    return out


def _print_summary(summary: dict, wall: float, root: Path, run_id: str, lora: bool = False) -> None:

    rows = read_metrics(root / metrics_prefix(run_id) / "trainer.jsonl")
    steps = [r for r in rows if "train/loss" in r]
    records = sum(r.get("rollout/accepted", 0) for r in steps)
    evals = summary.get("evals", [])
    print("\n[quickstart] summary")
    print(f"  run            {run_id}  ({root.resolve() / run_prefix(run_id)})")
    print(f"  steps          {summary.get('step')} (now at v{summary.get('version')})")
    print(f"  wall time      {wall / 60:.1f} min")
    print(f"  records/s      {records / wall:.3f} groups/s")
    if steps:
        first, last = steps[0]["rollout/reward_mean"], steps[-1]["rollout/reward_mean"]
        print(f"  reward mean    first {first:.3f} -> last {last:.3f}")
    if steps and "rollout/search_rate" in steps[0]:
        first, last = steps[0]["rollout/search_rate"], steps[-1]["rollout/search_rate"]
        print(f"  search rate    first {first:.3f} -> last {last:.3f} (training episodes)")
    for line in eval_lines(evals):
        print(line)
    where = root.resolve()
    held = ("the LoRA adapter, its optimizer state and PEFT files" if lora
            else "fp32 master weights (sharded checkpoint)")
    print(f"  model          v{summary.get('version')} published under {where / weights_prefix(run_id)}; "
          f"{held} in {where / checkpoint_files_prefix(run_id)}")
    print(f"  export         stoa export --bucket {root} --run {run_id} {run_id}-hf  (a Hugging Face "
          "directory for transformers and mlx-lm" + (")" if lora else "; --source checkpoint for the fp32 weights)"))
    print(f"  status         stoa status --bucket {root} --run {run_id}")
    print(f"  plot           stoa plot --bucket {root} --run {run_id} {run_id}.png  (pip install 'stoa[plot]')")
    print(f"  worker logs    {where / logs_prefix(run_id)}/worker<i>.log")
