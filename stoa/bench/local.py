"""``stoa bench local``: rollout tok/s, s/step, it/s and peak memory of the local mode (MLX, torch) and of
mlxrl."""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from stoa import tokenize
from stoa.bench.checkout import script_path
from stoa.config.base import ConfigError
from stoa.config.local import load_local_config
from stoa.config.text import deprecated_flag
from stoa.engines.mlx_blas import blas_status, find_mkl_rt
from stoa.local.loop import run_local
from stoa.models import resolve_model
from stoa.tasks import load_task
from stoa.telemetry.metrics import read_metrics

MLXRL_DRIVER = "mlxrl_driver.py"
"""The mlxrl timing driver in the checkout's ``benchmarks/``: run by the python of a separate venv with mlxrl."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``stoa bench local`` flags.

    Args:
        parser: the parser to extend.
    """
    parser.add_argument("--model", default="smollm2-135m",
                        help="model for every target [default: smollm2-135m]")
    parser.add_argument("--targets", default="torch,mlx",
                        help="comma list of: torch, mlx (stoa local mode), mlxrl [default: torch,mlx]")
    parser.add_argument("--n-samples", dest="group_size", metavar="N",
                        type=int, default=4, help="completions per prompt G [default: 4]")
    deprecated_flag(parser, "--group-size", "--n-samples")
    parser.add_argument("--max-new-tokens", dest="max_tokens", metavar="N",
                        type=int, default=64, help="completion length [default: 64]")
    deprecated_flag(parser, "--max-tokens", "--max-new-tokens")
    parser.add_argument("--steps", type=int, default=3,
                        help="measured steps (medians over them) [default: 3]")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured first steps [default: 1]")
    parser.add_argument("--beta", type=float, default=0.04,
                        help="KL weight for every target (> 0 runs the reference forward) [default: 0.04]")
    parser.add_argument("--quant-bits", type=int, default=4, help="base bits [default: 4]")
    parser.add_argument("--lora-rank", type=int, default=8, help="LoRA rank [default: 8]")
    parser.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA alpha (scale = alpha / rank)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="per-layer checkpointing everywhere")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads [default: 1]")
    parser.add_argument("--old-logprobs", default="forward", choices=("forward", "reuse"),
                        help="stoa targets: separate old-policy forward or reuse of the training forward")
    parser.add_argument("--label", default="", help="suffix for the stoa targets' names in the table")
    parser.add_argument("--stop-at-eos", action="store_true",
                        help="let completions stop at EOS (default: run to max tokens so every target does "
                             "the same work)")
    parser.add_argument("--mlxrl-python", default="/tmp/mlxrl-venv/bin/python",
                        help="python of a SEPARATE venv with inductive-mlxrl installed "
                             "[default: /tmp/mlxrl-venv/bin/python]")
    parser.add_argument("--mlxrl-rollout", default="naive", choices=("naive", "optimized"),
                        help="mlxrl rollout: naive (what its train command runs) or optimized "
                             "(prefix-cached)")
    parser.add_argument("--mlxrl-blas", default="same", choices=("same", "reference"),
                        help="BLAS for mlxrl on Linux: same (the MKL stoa's MLX target loads, when found) or "
                             "reference (the wheel's own) [default: same]")
    parser.add_argument("--json", default="", help="also write the results here")


def _child_local(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the stoa local loop in this (child) process and return per-step figures from its metrics."""


    if spec["ignore_eos"]:

        original = tokenize.TextCodec.__init__

        def init(self: Any, model_dir: Any) -> None:
            original(self, model_dir)
            self.eos_ids = ()

        tokenize.TextCodec.__init__ = init  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory(prefix="stoa-bench-") as out:
        cfg = load_local_config(None, {**spec["config"], "output_dir": out})
        run_local(cfg, echo=lambda _s: None)
        rows = [r for r in read_metrics(Path(out) / "metrics.jsonl") if "train/step_s" in r]
    return {"rows": [{"rollout_s": r["rollout/rollout_s"], "tokens": r["rollout/new_tokens"],
                      "tokens_per_s": r["rollout/tokens_per_s"], "step_s": r["train/step_s"],
                      "old_logp_s": r["train/old_logp_s"], "ref_logp_s": r["train/ref_logp_s"],
                      "update_s": r["train/update_s"]} for r in rows],
            # torch on CPU keeps no allocator statistics (its train/peak_memory_mb is the RSS high-water mark)
            "allocator_peak_mb": max((r.get("train/peak_memory_mb", 0.0) for r in rows), default=0.0)
            if spec["config"]["backend"] == "mlx" else float("nan"),
            "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "blas": _child_blas(spec["config"]["backend"])}


def _child_blas(backend: str) -> str:
    """The BLAS this child's matmuls used: MLX's (mkl/reference on Linux) or torch's."""
    if backend == "mlx":

        return blas_status().split(" (")[0]
    import torch

    return "torch mkldnn" if torch.backends.mkldnn.is_available() else "torch"


def _run_child(cmd: list[str], env: dict[str, str]) -> tuple[dict[str, Any], float, float]:
    """Run a child; return its RESULT json, its peak RSS in GB (its own ru_maxrss) and its wall time."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    out, err = proc.stdout, proc.stderr
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed (exit {proc.returncode}):\n{err[-3000:]}")
    line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"no RESULT line from {cmd[:3]}:\n{out[-2000:]}\n{err[-2000:]}")
    res = json.loads(line[len("RESULT "):])
    return res, res["peak_rss_kb"] / 1e6, wall


def _prompts(model_dir: Path, n: int) -> list[tuple[str, str]]:
    """(user message, answer) of the arithmetic task's first training prompts (seed 0), for mlxrl."""


    task = load_task("arithmetic")
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        p = task.sample_train(rng)
        out.append((p.messages[-1]["content"], p.answer))
    del model_dir
    return out


def main(args: argparse.Namespace) -> int:
    """Run each target in its own process and print the table (medians over the measured steps).

    Args:
        args: parsed ``add_arguments`` flags.
    """

    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if "mlxrl" in targets:  # say what is missing before any target runs
        script_path(MLXRL_DRIVER)
        if not Path(args.mlxrl_python).exists():
            raise ConfigError("mlxrl_python", f"{args.mlxrl_python} does not exist; create a separate venv: python "
                              "-m venv /tmp/mlxrl-venv && /tmp/mlxrl-venv/bin/pip install -r "
                              "benchmarks/requirements-mlxrl.txt")
    model_dir = resolve_model(args.model)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(args.threads)}
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                           "load_before": os.getloadavg()}, "targets": {}, "failed": {}}
    for target in targets:
        cmd = _command(target, args, model_dir)
        name = (f"{target}{args.label}" if target in ("torch", "mlx")
                else f"mlxrl ({args.mlxrl_rollout} rollout)")
        try:
            res, peak_gb, wall = _run_child(cmd, env)
        except RuntimeError as e:  # one broken target must not lose the others' figures
            print(f"[bench] {name}: FAILED: {e}", file=sys.stderr, flush=True)
            results["failed"][name] = str(e)[-2000:]
            continue
        results["targets"][name] = _figures(res, peak_gb, wall, args.warmup)
        print(f"[bench] {name}: done in {wall:.0f}s", flush=True)
        if args.json:  # after every target, so an interrupted run keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=1))
    results["machine"]["load_after"] = os.getloadavg()
    results["machine"]["mlx_blas_linux"] = blas_status()
    print(_table(results, args))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if results["failed"] else 0


def _command(target: str, args: argparse.Namespace, model_dir: Path) -> list[str]:
    """The child command of one target: stoa's local loop (``torch``, ``mlx``) or the mlxrl driver.

    Args:
        target: ``torch``, ``mlx`` or ``mlxrl``.
        args: parsed ``add_arguments`` flags.
        model_dir: the resolved model directory.
    """

    total = args.warmup + args.steps
    if target in ("torch", "mlx"):
        config = {"backend": target, "model": args.model, "task": "arithmetic", "n_samples": args.group_size,
                  "groups_per_step": 1, "max_new_tokens": args.max_tokens, "steps": total, "eval_n": 0,
                  "checkpoint_every": 0, "kl_beta": args.beta, "quant_bits": args.quant_bits,
                  "lora_rank": args.lora_rank, "lora_alpha": args.lora_alpha, "threads": args.threads,
                  "gradient_checkpointing": args.gradient_checkpointing, "max_prompt_tokens": 128,
                  "preflight": False, "old_logprobs": args.old_logprobs}
        spec: dict[str, Any] = {"config": config, "ignore_eos": not args.stop_at_eos}
        return [sys.executable, "-m", "stoa.bench.local", "--child", json.dumps(spec)]
    if target == "mlxrl":
        spec = {"model_dir": str(model_dir), "prompts": _prompts(model_dir, total), "G": args.group_size,
                "max_tokens": args.max_tokens, "beta": args.beta, "bits": args.quant_bits, "group_size_q": 64,
                "rank": args.lora_rank, "scale": args.lora_alpha / args.lora_rank, "lr": 1e-4,
                "checkpointing": args.gradient_checkpointing, "ignore_eos": not args.stop_at_eos,
                "rollout": args.mlxrl_rollout, "mkl_rt": find_mkl_rt() if args.mlxrl_blas == "same" else None}
        return [args.mlxrl_python, str(script_path(MLXRL_DRIVER)), json.dumps(spec)]
    raise ValueError(f"--targets: unknown target {target!r} (torch, mlx, mlxrl)")


def _figures(res: dict[str, Any], peak_gb: float, wall: float, warmup: int) -> dict[str, Any]:
    """A target's figures: medians over the steps after ``warmup``, peaks, wall time and the raw rows.

    Args:
        res: the child's RESULT.
        peak_gb: the child's peak RSS in GB.
        wall: the child's wall time in seconds.
        warmup: unmeasured first steps.
    """
    rows = res["rows"][warmup:]
    step_s = statistics.median(r["step_s"] for r in rows)
    return {"rollout_tok_s": statistics.median(r["tokens_per_s"] for r in rows), "s_per_step": step_s,
            "it_s": 1.0 / step_s, "peak_rss_gb": peak_gb, "allocator_peak_gb": res["allocator_peak_mb"] / 1e3,
            "steps": len(rows), "wall_s": wall, "rows": res["rows"], "blas": res.get("blas", "")}


def _table(results: dict[str, Any], args: argparse.Namespace) -> str:
    """The printed table: a settings line, one markdown row per target, then ratios against mlxrl.

    Args:
        results: what :func:`main` measured (machine, targets, failed).
        args: parsed ``add_arguments`` flags.
    """
    m = results["machine"]
    lines = [f"model {args.model}, G={args.group_size}, {args.max_tokens} new tokens, 1 prompt/step, "
             f"beta {args.beta}, {args.quant_bits}-bit base, LoRA r={args.lora_rank}; "
             f"medians of {args.steps} steps after {args.warmup} warm-up; {m['cpus']} CPUs, "
             f"load {m['load_before'][0]:.1f} -> {m['load_after'][0]:.1f}; MLX BLAS: {m['mlx_blas_linux']}",
             "| target | BLAS | rollout tok/s | s/step | it/s | peak RSS GB | allocator peak GB |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in results["targets"].items():
        lines.append(f"| {name} | {r.get('blas') or '-'} | {r['rollout_tok_s']:.1f} | "
                     f"{r['s_per_step']:.2f} | {r['it_s']:.3f} | {r['peak_rss_gb']:.2f} | "
                     f"{r['allocator_peak_gb']:.2f} |")
    lines += [f"| {name} | FAILED (see stderr) | | | | | |" for name in results.get("failed", {})]
    targets = results["targets"]
    base = next((n for n in targets if n.startswith("mlxrl")), None)
    for name in targets:
        if base and name != base:
            ours, theirs = targets[name], targets[base]
            lines.append(f"{name} / {base}: it/s {ours['it_s'] / theirs['it_s']:.2f}x, "
                         f"rollout tok/s {ours['rollout_tok_s'] / theirs['rollout_tok_s']:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(_child_local(json.loads(sys.argv[2]))), flush=True)
        sys.exit(0)
    p = argparse.ArgumentParser(prog="python -m stoa.bench.local", description=__doc__)
    add_arguments(p)
    sys.exit(main(p.parse_args()))
