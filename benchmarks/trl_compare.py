"""``stoa bench trl``: our ``train_step`` and TRL's ``GRPOTrainer`` side by side.

Both run the same model, batch shape (B prompts x n generations, T new tokens, ~P-token prompts), KL weight and
thread count, full fine-tune in fp32 on the CPU, or with ``--lora-rank R`` the same LoRA adapter (rank, alpha,
targets; TRL's a ``peft.LoraConfig`` as ``peft_config``; each side's KL reference its base with the adapters off).
They alternate (ours, TRL, ours, TRL, ...; with LoRA our full fine-tune too, the baseline of our LoRA peak), each
repeat in a fresh subprocess so each peak RSS is its own. TRL runs in its own venv under ``$STOA_CACHE/venvs``, made
on first use from the pins of ``requirements-trl.txt`` beside this file, through ``trl_driver.py``, which prints a
``RESULT {json}`` line; our side runs this script with ``--child``. TRL's generation time is reported apart; the
last line printed is ``ratio_step=X ratio_mem=Y`` (X: TRL's seconds per step without generation / ours, Y: our
peak RSS / TRL's). Run it as ``stoa bench trl [flags]`` or ``python benchmarks/trl_compare.py [flags]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoa.bench.trainer import on_policy, policy_kwargs, reference, synthetic_entries
from stoa.config.text import dtype_value
from stoa.config.trainer import LORA_TARGETS
from stoa.models import default_cache_dir, resolve_model

TRL_DRIVER = Path(__file__).with_name("trl_driver.py")
"""The TRL timing driver: a script run by the python of TRL's own venv."""

TRL_PINS = Path(__file__).with_name("requirements-trl.txt")
"""TRL's venv requirements: exact versions, torch equal to stoa's so both sides run the same kernels."""


def read_pins(path: Path) -> tuple[str, ...]:
    """The requirement lines of a requirements file (comments and blank lines left out).

    Args:
        path: the requirements file.
    """
    lines = (line.partition("#")[0].strip() for line in path.read_text().splitlines())
    return tuple(line for line in lines if line)


TRL_REQUIREMENTS = read_pins(TRL_PINS)
"""What TRL's venv holds (``requirements-trl.txt``)."""


def trl_venv_dir() -> Path:
    """Where TRL's venv lives: ``$STOA_CACHE/venvs/trl-<hash of TRL_REQUIREMENTS>`` (a new pin, a new venv)."""
    digest = hashlib.sha256("\n".join(TRL_REQUIREMENTS).encode()).hexdigest()[:10]
    return default_cache_dir() / "venvs" / f"trl-{digest}"


def ensure_trl_venv(echo: Any = print) -> Path:
    """TRL's venv python, creating the venv (``python -m venv`` + ``pip install`` of the pins) when absent.

    Args:
        echo: progress callback.
    """
    venv = trl_venv_dir()
    python, done = venv / "bin" / "python", venv / ".stoa-ready"
    if done.exists():
        return python
    echo(f"[bench] creating TRL's venv at {venv} ({' '.join(TRL_REQUIREMENTS)}); this takes a few minutes")
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--clear", str(venv)], check=True)
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", *TRL_REQUIREMENTS], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip install into {venv} failed (fix the pins in benchmarks/requirements-trl.txt "
                           f"or the pip index, then rerun): {proc.stderr.strip()[-1500:]}")
    done.write_text("\n".join(TRL_REQUIREMENTS) + "\n")
    return python

DEFAULT_BETA = 0.001
"""The KL weight compared when ``--kl-beta`` is left at 0 (both sides then run a reference forward)."""


@dataclass(frozen=True)
class Side:
    """One side's medians over its repeats: seconds per step (TRL: without generation), trained tokens/s, peak RSS
    (GB), for TRL the generation seconds and whole-step seconds per step (0 for ours), the CPU seconds of the
    step (TRL: without generation; all threads; 0 when a child did not report them) and the parameters the
    optimizer steps (0 when not reported)."""

    step_s: float
    tokens_per_s: float
    peak_rss_gb: float
    gen_s: float = 0.0
    full_step_s: float = 0.0
    cpu_s: float = 0.0
    trained_params: int = 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``stoa bench trl``: the shape both sides run, the repeats and the threads.

    Args:
        p: the benchmark's parser.
    """
    p.add_argument("--model", default="smollm2-135m", help="model name or path [default: smollm2-135m]")
    p.add_argument("--groups", type=int, default=8, help="prompts per step (B) [default: 8]")
    p.add_argument("--n-samples", dest="n", metavar="N", type=int, default=8,
                   help="generations per prompt [default: 8]")
    p.add_argument("--prompt-tokens", type=int, default=48, help="prompt length [default: 48]")
    p.add_argument("--max-new-tokens", dest="tokens", metavar="N", type=int, default=64,
                   help="completion length [default: 64]")
    p.add_argument("--repeats", type=int, default=3,
                   help="fresh processes per side, interleaved [default: 3]")
    p.add_argument("--kl-beta", type=float, default=0.0,
                   help=f"KL coefficient; 0 compares at {DEFAULT_BETA} (both sides run a reference forward)")
    p.add_argument("--micro-batch", type=int, default=16, help="rows per micro-batch on both sides [default: 16]")
    p.add_argument("--dtype", default="float32", type=dtype_value, choices=("float32", "bfloat16"),
                   help="our Policy's compute dtype [default: float32]")
    p.add_argument("--compute-weights", default="bf16_copy", choices=("autocast", "bf16_copy"),
                   help="how our bfloat16 policy computes: a bf16 copy of the fp32 masters (the trainer's default) "
                        "or autocast on them [default: bf16_copy]")
    p.add_argument("--shared-prefix", action="store_true",
                   help="our step runs each group's prompt once (one group per micro-batch); default: packed "
                        "micro-batches, as TRL")
    p.add_argument("--trl-bf16", action="store_true",
                   help="TRL with bf16=True (autocast on its fp32 masters; AdamW state stays fp32) [default: fp32]")
    p.add_argument("--threads", type=int, default=2, help="torch threads on both sides [default: 2]")
    p.add_argument("--steps", type=int, default=1, help="timed steps per process, after one warm-up step "
                                                        "[default: 1]")
    p.add_argument("--out", default="", help="append one JSON row with every child's figures to this file")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="both sides train a LoRA adapter of this rank on the frozen base (TRL: peft_config); "
                        "0 = full fine-tune [default: 0]")
    p.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA alpha on both sides [default: 32]")
    p.add_argument("--lora-targets", default=LORA_TARGETS,
                   help=f"module-name suffixes both sides adapt, comma-separated [default: {LORA_TARGETS}]")
    p.add_argument("--no-full", action="store_true",
                   help="with --lora-rank: leave out our full fine-tune (the baseline of the LoRA peak RSS)")


def child_spec(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """The shape both sides run, as the JSON a child reads.

    Args:
        args: parsed ``stoa bench trl`` flags.
        model_dir: the resolved model directory.
    """
    targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    if args.lora_rank < 0 or (args.lora_rank and not targets):
        raise ValueError("--lora-rank must be >= 0 (0: full fine-tune) and LoRA needs --lora-targets (q_proj,v_proj)")
    return {"model_dir": str(model_dir), "prompts": args.groups, "generations": args.n, "tokens": args.tokens,
            "prompt_tokens": args.prompt_tokens, "micro_batch": args.micro_batch,
            "beta": args.kl_beta or DEFAULT_BETA, "lr": 1e-6, "warmup": 1, "steps": args.steps, "seed": 0,
            "threads": args.threads, "dtype": args.dtype, "compute_weights": args.compute_weights,
            "shared_prefix": args.shared_prefix, "trl_bf16": args.trl_bf16,
            "lora_rank": args.lora_rank, "lora_alpha": args.lora_alpha, "lora_targets": targets}


def ours_argv(spec: dict[str, Any]) -> list[str]:
    """Our side's child command (stoa's python).

    Args:
        spec: :func:`child_spec`'s JSON.
    """
    return [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]


def trl_argv(python: Path, spec: dict[str, Any]) -> list[str]:
    """TRL's child command: its venv's python on ``trl_driver.py``.

    Args:
        python: TRL's venv python.
        spec: :func:`child_spec`'s JSON.
    """
    return [str(python), str(TRL_DRIVER), json.dumps(spec)]


def parse_result(stdout: str) -> dict[str, Any]:
    """The JSON of a child's ``RESULT {json}`` line (the last one).

    Args:
        stdout: the child's standard output.
    """
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise ValueError(f"no RESULT line in the child's output (its tail: {stdout[-500:]!r}); run it by hand")
    return json.loads(lines[-1][len("RESULT "):])


def summarize(results: list[dict[str, Any]], warmup: int, trl: bool) -> Side:
    """Medians over every timed step of every repeat of one side, and the median peak RSS.

    Args:
        results: the side's child RESULTs, one per repeat.
        warmup: unmeasured first steps of each child.
        trl: TRL's RESULTs (``train_s`` = step without generation) rather than ours.
    """
    rows = [r for res in results for r in res["rows"][warmup:]]
    rss = statistics.median(res["peak_rss_kb"] for res in results) / 1e6
    step = statistics.median(r["train_s" if trl else "step_s"] for r in rows)
    tokens = statistics.median(r["tokens"] for r in rows)
    cpu = statistics.median(r.get("train_cpu_s" if trl else "cpu_s", 0.0) for r in rows)
    params = int(results[0].get("trained_params", 0))
    if not trl:
        return Side(step, tokens / step, rss, cpu_s=cpu, trained_params=params)
    return Side(step, tokens / step, rss, statistics.median(r["gen_s"] for r in rows),
                statistics.median(r["step_s"] for r in rows), cpu, params)


def ratio_line(ours: Side, trl: Side) -> str:
    """``ratio_step=X ratio_mem=Y``: X = TRL's s/step without generation / ours, Y = our peak RSS / TRL's.

    Args:
        ours: our side.
        trl: TRL's side.
    """
    return f"ratio_step={trl.step_s / ours.step_s:.2f} ratio_mem={ours.peak_rss_gb / trl.peak_rss_gb:.2f}"


def run_ours(spec: dict[str, Any]) -> dict[str, Any]:
    """Our side in this (child) process: ``warmup + steps`` packed ``train_step``s on synthetic groups.

    Args:
        spec: :func:`child_spec`'s JSON.
    """
    import torch

    from stoa.algorithms import AlgoConfig, get_algorithm
    from stoa.models.lora_torch import LoraSpec
    from stoa.trainer.policy import Policy
    from stoa.trainer.step import train_step

    torch.set_num_threads(spec["threads"])
    device = torch.device("cpu")
    kw = policy_kwargs(spec["dtype"], spec.get("compute_weights", "bf16_copy"))
    rank = spec.get("lora_rank", 0)
    lora = LoraSpec(rank, spec["lora_alpha"], tuple(spec["lora_targets"])) if rank else None
    policy = Policy(spec["model_dir"], device, lora=lora, **kw)
    ref = reference(policy, spec["model_dir"], spec["beta"], **kw)  # LoRA: its own base, adapters off (BaseView)
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=spec["lr"])
    algo = get_algorithm(AlgoConfig.from_dict({"name": "grpo", "kl_beta": spec["beta"],
                                               "max_tokens": spec["tokens"]}), "torch")
    rows = []
    for r in range(spec["warmup"] + spec["steps"]):
        raw = synthetic_entries(spec["prompts"], spec["generations"], spec["prompt_tokens"], spec["tokens"],
                                policy.vocab_size, spec["seed"] + r)
        entries = on_policy(raw, policy, spec["tokens"])
        t0, c0 = time.perf_counter(), time.process_time()
        train_step(policy, ref, opt, algo, entries, current_version=1, micro_batch=spec["micro_batch"],
                   grad_clip=1.0, shared_prefix=spec.get("shared_prefix", False),
                   recompute_limit=float("inf"))  # synthetic records: no worker's logprobs to judge
        rows.append({"step_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                     "tokens": float(spec["prompts"] * spec["generations"] * spec["tokens"])})
    return {"rows": rows, "threads": torch.get_num_threads(),
            "trained_params": sum(p.numel() for p in policy.trainable_parameters()),
            "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def run_child(cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Run one child to the end and return its RESULT.

    Args:
        cmd: the child's argv.
        env: its environment.
    """
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} {cmd[1]} failed (exit {proc.returncode}); its stderr ends: "
                           f"{proc.stderr.strip()[-1500:]}")
    return parse_result(proc.stdout)


FULL = "ours full FT"
"""The name of our full fine-tune beside a LoRA comparison (the baseline of our LoRA peak RSS)."""


def children(spec: dict[str, Any], python: Path, no_full: bool = False) -> list[tuple[str, list[str]]]:
    """Each repeat's children in order: ours, TRL's and, with LoRA, our full fine-tune (unless ``no_full``).

    Args:
        spec: :func:`child_spec`'s JSON.
        python: TRL's venv python.
        no_full: leave our full fine-tune out.
    """
    runs = [("ours", ours_argv(spec)), ("TRL", trl_argv(python, spec))]
    if spec["lora_rank"] and not no_full:
        runs.append((FULL, ours_argv({**spec, "lora_rank": 0})))
    return runs


def main(args: argparse.Namespace) -> int:
    """Interleave our side and TRL's (``--repeats`` times each, every run a fresh process; with LoRA our full
    fine-tune too); print the table and, last, the ratio line.

    Args:
        args: parsed flags (see :func:`add_arguments`).
    """
    model_dir = resolve_model(args.model)
    python = ensure_trl_venv()
    spec = child_spec(args, model_dir)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(args.threads)}
    load = os.getloadavg()[0]
    runs = children(spec, python, args.no_full)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in runs}
    for r in range(args.repeats):
        for name, cmd in runs:
            t0 = time.perf_counter()
            results[name].append(run_child(cmd, env))
            print(f"[bench] repeat {r + 1}/{args.repeats} {name}: {time.perf_counter() - t0:.0f}s", flush=True)
    if args.out:
        with Path(args.out).open("a") as f:
            f.write(json.dumps({"bench": "trainer-vs-trl", "spec": spec, "ours": results["ours"],
                                "trl": results["TRL"], "ours_full": results.get(FULL, [])}) + "\n")
    ours, theirs = summarize(results["ours"], spec["warmup"], False), summarize(results["TRL"], spec["warmup"], True)
    full = summarize(results[FULL], spec["warmup"], False) if FULL in results else None
    print(table(spec, ours, theirs, results["TRL"][0]["versions"], (load, os.getloadavg()[0]), full))
    print(ratio_line(ours, theirs))
    return 0


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def precisions(spec: dict[str, Any]) -> tuple[str, str]:
    """How each side computes, in words: ours (dtype, compute weights or a LoRA's bf16 base, packed or shared prefix)
    and TRL's."""
    bf16 = "bf16 base" if spec.get("lora_rank") else f"bf16 {spec.get('compute_weights', 'bf16_copy')}"
    ours = ("fp32" if spec["dtype"] == "float32" else bf16) + (", shared prefix" if spec.get("shared_prefix")
                                                               else ", packed")
    return ours, "bf16=True (autocast)" if spec.get("trl_bf16") else "fp32"


def training(spec: dict[str, Any]) -> str:
    """What both sides train, in words: the full model, or the same LoRA adapter (rank, alpha, targets)."""
    if not spec.get("lora_rank"):
        return "full fine-tune"
    return (f"LoRA r={spec['lora_rank']} alpha={spec['lora_alpha']:g} targets={','.join(spec['lora_targets'])} on "
            "both sides (TRL: peft_config; KL reference: the base with adapters off)")


def table(spec: dict[str, Any], ours: Side, trl: Side, versions: dict[str, str], load: tuple[float, float],
          full: Side | None = None) -> str:
    """The printed comparison: a settings line, a markdown table and notes.

    Args:
        spec: the shape both sides ran.
        ours: our side.
        trl: TRL's side.
        versions: TRL's venv versions.
        load: the 1-minute load average before and after.
        full: our full fine-tune beside a LoRA comparison (None: none ran).
    """
    rows = spec["prompts"] * spec["generations"]
    mine, theirs = precisions(spec)
    head = (f"{spec['prompts']} prompts x {spec['generations']} generations, ~{spec['prompt_tokens']}-token prompts + "
            f"{spec['tokens']} new tokens, micro-batch {spec['micro_batch']} of {rows} rows, beta {spec['beta']}, "
            f"{training(spec)}, ours {mine} / TRL {theirs}, fp32 AdamW; {cpu_name()}, {spec['threads']} threads; "
            f"trl {versions['trl']}, transformers {versions['transformers']}, torch {versions['torch']}; "
            f"load {load[0]:.1f} -> {load[1]:.1f}")
    lines = [
        head, "| side | s/step | CPU s/step | trained tok/s | peak RSS GB | generation s/step |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        f"| stoa train_step ({mine}) | {ours.step_s:.2f} | {ours.cpu_s:.1f} | {ours.tokens_per_s:.0f} | "
        f"{ours.peak_rss_gb:.2f} | - |",
        f"| TRL GRPOTrainer ({theirs}) without generation | {trl.step_s:.2f} | {trl.cpu_s:.1f} | "
        f"{trl.tokens_per_s:.0f} | {trl.peak_rss_gb:.2f} | {trl.gen_s:.2f} |",
        f"| TRL GRPOTrainer whole step | {trl.full_step_s:.2f} | - | "
        f"{trl.tokens_per_s * trl.step_s / trl.full_step_s:.0f} | {trl.peak_rss_gb:.2f} | {trl.gen_s:.2f} |"]
    if full is not None:
        lines.append(f"| stoa train_step ({precisions({**spec, 'lora_rank': 0})[0]}), full fine-tune | "
                     f"{full.step_s:.2f} | {full.cpu_s:.1f} | {full.tokens_per_s:.0f} | {full.peak_rss_gb:.2f} | - |")
    lines.append(f"CPU seconds (all threads; less moved by other load than wall time): TRL / ours "
                 f"{trl.cpu_s / ours.cpu_s if ours.cpu_s else 0.0:.2f}")
    lines.append(f"parameters the optimizer steps: ours {ours.trained_params:,}, TRL {trl.trained_params:,}")
    if full is not None:
        lines.append(f"our peak RSS, LoRA / full fine-tune: {ours.peak_rss_gb / full.peak_rss_gb:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(run_ours(json.loads(sys.argv[2]))), flush=True)
        sys.exit(0)
    _parser = argparse.ArgumentParser(prog="python benchmarks/trl_compare.py", description=__doc__)
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
