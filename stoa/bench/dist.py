"""Data-parallel trainer step (FSDP2 under torchrun): step seconds, tokens/s, peak memory per rank, MFU on CUDA,
and whether the published planes of G ranks equal one process's after the same steps from the same start.

``--nproc G`` re-launches this benchmark under ``torch.distributed.run --standalone`` (unless already under
torchrun); every rank builds ``Policy(dist=...)`` and runs ``train_step`` on the same synthetic entries. With
``--compare`` a world-size-1 run goes first (its own process, so each peak is its own); rank 0 of the G run then
compares its gathered fp32 master weights with it (max |delta|) and the bf16 and int8g64 planes' bytes (hashes).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from safetensors import safe_open

from stoa.algorithms import AlgoConfig, get_algorithm
from stoa.bench.trainer import synthetic_entries
from stoa.config.text import deprecated_flag, dtype_value
from stoa.models.random_llama import resolve_bench_model
from stoa.weights.planes import PLANES, f32_to_bf16_bits, state_from_f32

PEAK_BF16_TFLOPS = (("H200", 989.0), ("H100", 989.0), ("A100", 312.0))
"""Dense bf16 peak TFLOP/s by device-name substring (SXM figures); others need ``--peak-tflops``."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``stoa bench dist``.

    Args:
        p: the subcommand's parser.
    """
    p.add_argument("--model", default="tiny", help="tiny, smollm2-135m, llama-1b (random, built locally) or a "
                                                   "model directory [default: tiny]")
    p.add_argument("--nproc", type=int, default=1, help="ranks (G); >1 re-launches under torchrun [default: 1]")
    p.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per rank) [default: cpu]")
    p.add_argument("--dtype", type=dtype_value, choices=("float32", "bfloat16"), default=None,
                   help="compute dtype (master weights stay float32) [default: bfloat16 on CUDA, float32 on CPU]")
    p.add_argument("--groups", type=int, default=4, help="groups per step (B) [default: 4]")
    p.add_argument("--n-samples", dest="n", metavar="N", type=int, default=4,
                   help="samples per group [default: 4]")
    deprecated_flag(p, "--n", "--n-samples")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length [default: 32]")
    p.add_argument("--max-new-tokens", dest="tokens", metavar="N",
                   type=int, default=32, help="completion length [default: 32]")
    deprecated_flag(p, "--tokens", "--max-new-tokens")
    p.add_argument("--repeats", type=int, default=2, help="timed steps after one warm-up step [default: 2]")
    p.add_argument("--mode", choices=("shared", "packed"), default="shared",
                   help="shared-prefix or packed micro-batches (gradient checkpointing forces packed)")
    p.add_argument("--micro-batch", type=int, default=16, help="packed-mode rows per micro-batch [default: 16]")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate [default: 1e-5]")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="recompute activations in backward [default: on for llama-1b, else off]")
    p.add_argument("--compare", action="store_true", help="run world size 1 first and check the G run against it")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="the device's dense bf16 peak for MFU when its name is not in PEAK_BF16_TFLOPS")
    p.add_argument("--out", default="", help="append JSONL rows to this file")
    p.add_argument("--save-final", default="", help=argparse.SUPPRESS)  # the reference run's fp32 weights (.npz)
    p.add_argument("--reference", default="", help=argparse.SUPPRESS)  # compare with this --save-final file
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # launched by run(): no table


@dataclass
class Row:
    """One setting's figures (rank 0's view). ``step_s``: median of the timed steps; ``tokens_per_s``: trained
    (completion) tokens; ``peak_gib``: per rank, CUDA ``max_memory_allocated`` or CPU peak RSS; ``digests``: plane ->
    xxh3-128 of rank 0's published bytes; ``bf16_moved``: share of bf16 elements changed since the start (what the
    check can see); with a reference run: ``max_abs_delta`` of the fp32 masters, ``planes_equal`` per plane and
    ``bf16_mismatch`` (bf16 elements that differ)."""

    model: str
    device: str
    device_name: str
    dtype: str
    world: int
    groups: int
    n: int
    prompt_tokens: int
    tokens: int
    shared_prefix: bool
    gradient_checkpointing: bool
    threads: int
    params: int
    step_s: float
    step_s_min: float
    step_s_max: float
    tokens_per_s: float
    peak_gib: list[float]
    mfu: float | None
    digests: dict[str, str] = field(default_factory=dict)
    bf16_moved: float = 0.0
    max_abs_delta: float | None = None
    planes_equal: dict[str, bool] | None = None
    bf16_mismatch: int | None = None
    bench: str = "dist"

    @property
    def bits_ok(self) -> bool | None:
        """Whether every plane's bytes equal the reference's; None without a reference."""
        return None if self.planes_equal is None else all(self.planes_equal.values())


def torchrun_argv(bench_argv: list[str], nproc: int, python: str) -> list[str]:
    """The command running ``stoa <bench_argv>`` as ``nproc`` ranks on this machine (``--`` keeps torchrun's
    parser off the benchmark's flags: it would take ``--r...`` for its ``--run-path``).

    Args:
        bench_argv: ``stoa``'s arguments (``bench dist ...``).
        nproc: ranks.
        python: the interpreter.
    """
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m", "stoa",
            "--", *bench_argv]


_NOT_PASSED = ("nproc", "compare", "out", "save_final", "reference", "child")


def child_argv(args: argparse.Namespace, nproc: int, out: str, *, save_final: str = "", reference: str = ""
               ) -> list[str]:
    """``stoa`` arguments re-running this benchmark's setting (every flag but ``--compare``) at ``nproc`` ranks.

    Args:
        args: this run's flags.
        nproc: the child's ranks.
        out: where the child appends its row.
        save_final: write the final fp32 weights here (the reference run).
        reference: compare with this saved reference.
    """
    argv = ["bench", "dist", "--nproc", str(nproc), "--out", out, "--child"]
    for key, value in sorted(vars(args).items()):
        flag = {"n": "--n-samples", "tokens": "--max-new-tokens"}.get(key, "--" + key.replace("_", "-"))
        if key in _NOT_PASSED or value is None or value == "":
            continue
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, repr(value) if isinstance(value, float) else str(value)]
    return argv + (["--save-final", save_final] if save_final else []) + (
        ["--reference", reference] if reference else [])


def peak_bf16_flops(device_name: str, override_tflops: float = 0.0) -> float | None:
    """Dense bf16 peak FLOP/s of one device: ``override_tflops`` if set, else by name; None if unknown.

    Args:
        device_name: e.g. ``torch.cuda.get_device_name()``.
        override_tflops: ``--peak-tflops``.
    """
    if override_tflops > 0:
        return override_tflops * 1e12
    return next((tf * 1e12 for key, tf in PEAK_BF16_TFLOPS if key in device_name.upper()), None)


def mfu(params: int, model_tokens: int, step_s: float, peak_flops: float, world: int) -> float:
    """Model FLOPs utilisation: ``6 * params * tokens`` per step over what ``world`` devices could do.

    Args:
        params: model parameters.
        model_tokens: tokens forwarded and backwarded per step (all ranks together).
        step_s: seconds per step.
        peak_flops: one device's peak FLOP/s.
        world: devices.
    """
    return 6.0 * params * model_tokens / step_s / (peak_flops * world)


def plane_digests(named: Mapping[str, np.ndarray]) -> dict[str, str]:
    """Per published plane, the xxh3-128 of its tensors' names, dtypes, shapes and bytes (sorted by name).

    Args:
        named: fp32 master weights.
    """


    out = {}
    for plane in PLANES:
        h = xxhash.xxh3_128()
        state = state_from_f32(named, plane)
        for name in sorted(state):
            a = np.ascontiguousarray(state[name])
            h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
            h.update(a.tobytes())
        out[plane] = h.hexdigest()
    return out


def compare(row: Row, final: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray], ref_digests: dict[str, str]
            ) -> None:
    """Fill ``row``'s comparison with a reference run (max |delta| of the masters, planes equal, bf16 differences).

    Args:
        row: this run's row (``digests`` set).
        final: this run's fp32 master weights.
        ref: the reference's fp32 master weights.
        ref_digests: the reference's plane digests.
    """

    if set(final) != set(ref):
        raise ValueError("the reference run has other parameter names; compare runs of the same --model")
    delta, mismatch = 0.0, 0
    for name, a in final.items():
        b = np.asarray(ref[name])
        delta = max(delta, float(np.max(np.abs(a - b))) if a.size else 0.0)
        mismatch += int(np.count_nonzero(f32_to_bf16_bits(a) != f32_to_bf16_bits(b)))
    row.max_abs_delta, row.bf16_mismatch = delta, mismatch
    row.planes_equal = {p: row.digests[p] == ref_digests.get(p) for p in row.digests}


def bf16_moved(model_dir: Path, final: Mapping[str, np.ndarray]) -> float:
    """Share of bf16 plane elements of ``final`` that differ from the model directory's starting weights.

    Args:
        model_dir: the model (its ``*.safetensors``).
        final: fp32 master weights after the steps.
    """


    moved = total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "numpy") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in final:
                    start = f32_to_bf16_bits(f.get_tensor(name))
                    moved += int(np.count_nonzero(f32_to_bf16_bits(final[name]) != start))
                    total += start.size
    return moved / total if total else 0.0


def _peak_gib(device: Any) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _make_policy(args: argparse.Namespace, model_dir: Path, dist: Any, device: Any) -> Any:
    """The policy at ``--dtype``: sharded ranks compute in the gathered dtype, one process autocasts to bf16."""
    import torch

    from stoa.trainer.policy import Policy

    bf16 = _dtype(args, device) == "bfloat16"
    ckpt = args.model == "llama-1b" if args.gradient_checkpointing is None else args.gradient_checkpointing
    policy = Policy(model_dir, device, gradient_checkpointing=ckpt, dist=dist,
                    compute_dtype=torch.bfloat16 if bf16 else torch.float32)
    return policy


def _dtype(args: argparse.Namespace, device: Any) -> str:
    return args.dtype or ("bfloat16" if device.type == "cuda" else "float32")


def run_setting(args: argparse.Namespace, model_dir: Path, dist: Any, device: Any
                ) -> tuple[Row, dict[str, np.ndarray]]:
    """One warm-up and ``--repeats`` timed ``train_step``s on every rank; rank 0's row and final fp32 weights
    (``{}`` on other ranks, whose row carries only their timings).

    Args:
        args: the flags.
        model_dir: the model.
        dist: the ranks (``stoa.trainer.dist.Dist``).
        device: this rank's device.
    """
    import torch

    from stoa.trainer.step import train_step

    policy = _make_policy(args, model_dir, dist, device)
    opt = torch.optim.AdamW(policy.model.parameters(), lr=args.lr)
    algo = get_algorithm(AlgoConfig.from_dict({"name": "grpo", "kl_beta": 0.0, "max_tokens": args.tokens}), "torch")
    shared = args.mode == "shared" and not policy.gradient_checkpointing
    times = []
    for r in range(args.repeats + 1):  # step 0 warms up and is not timed
        entries = synthetic_entries(args.groups, args.n, args.prompt_tokens, args.tokens, policy.vocab_size, r)
        dist.barrier()
        t0 = time.perf_counter()
        train_step(policy, None, opt, algo, entries, current_version=1, micro_batch=args.micro_batch,
                   grad_clip=1.0, shared_prefix=shared, dist=dist,
                   recompute_limit=float("inf"))  # synthetic records: no worker's logprobs to judge
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if r:
            times.append(time.perf_counter() - t0)
    peaks = dist.gather(_peak_gib(device))
    params = sum(p.numel() for p in policy.model.parameters())
    step_s = statistics.median(times)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_bf16_flops(name, args.peak_tflops) if device.type == "cuda" else None
    # tokens through the model per step: each group's prompt once (shared prefix) or once per row (packed)
    model_tokens = args.groups * (args.prompt_tokens * (1 if shared else args.n) + args.n * args.tokens)
    row = Row(args.model, str(device), name, _dtype(args, device), dist.world_size, args.groups, args.n,
              args.prompt_tokens, args.tokens, shared, policy.gradient_checkpointing, torch.get_num_threads(),
              params, step_s, min(times), max(times), args.groups * args.n * args.tokens / step_s, peaks,
              mfu(params, model_tokens, step_s, peak, dist.world_size) if peak else None)
    final = policy.export_f32()
    if dist.main:
        row.digests = plane_digests(final)
        row.bf16_moved = bf16_moved(model_dir, final)
    return row, final


def _write(rows: list[Row], out: str) -> None:
    if out:
        with Path(out).open("a") as f:
            f.writelines(json.dumps(asdict(r)) + "\n" for r in rows)


def run_ranks(args: argparse.Namespace) -> Row | None:
    """This process's part of a torchrun job (``WORLD_SIZE`` set): rank 0's row, None on other ranks.

    Args:
        args: the flags (``--reference``: compare with a saved world-size-1 run).
    """
    from stoa.trainer.dist import close_dist, init_dist

    dist, device = init_dist(args.device)
    try:
        row, final = run_setting(args, resolve_bench_model(args.model), dist, device)
    finally:
        close_dist(dist)
    if not dist.main:
        return None
    if args.reference:
        compare(row, final, np.load(args.reference), json.loads(Path(args.reference + ".json").read_text()))
    _write([row], args.out)
    return row


def run(args: argparse.Namespace) -> list[Row]:
    """Every setting's row: world size 1 first with ``--compare``, then G ranks (in this process when G is 1,
    else under torchrun, each in fresh processes).

    Args:
        args: the flags.
    """
    from stoa.engines.torch import resolve_device
    from stoa.trainer.dist import SINGLE

    if args.repeats < 1 or args.nproc < 1:
        raise ValueError("bench dist: --repeats and --nproc must be >= 1")
    model_dir = resolve_bench_model(args.model)  # built once, before any rank looks for it
    if args.nproc <= 1:
        device = resolve_device(args.device)
        rows = []
        ref: tuple[dict[str, np.ndarray], dict[str, str]] | None = None
        for _ in range(2 if args.compare else 1):
            row, final = run_setting(args, model_dir, SINGLE, device)
            if ref is not None:
                compare(row, final, *ref)
            ref = (final, row.digests)
            rows.append(row)
        if args.save_final:  # the reference of a G-rank run: its fp32 weights and plane digests
            np.savez(args.save_final, allow_pickle=False, **final)
            Path(args.save_final + ".json").write_text(json.dumps(rows[-1].digests))
        _write(rows, args.out)
        return rows
    with tempfile.TemporaryDirectory(prefix="stoa-bench-dist-") as tmp:
        out, reference = str(Path(tmp) / "rows.jsonl"), str(Path(tmp) / "reference.npz")
        if args.compare:
            _launch([sys.executable, "-m", "stoa", *child_argv(args, 1, out, save_final=reference)])
        _launch(torchrun_argv(child_argv(args, args.nproc, out, reference=reference if args.compare else ""),
                              args.nproc, sys.executable))
        rows = [Row(**{k: v for k, v in json.loads(line).items() if k != "bench"})
                for line in Path(out).read_text().splitlines()]
    _write(rows, args.out)
    return rows


def _launch(argv: list[str]) -> None:
    done = subprocess.run(argv, check=False)  # noqa: S603 (this benchmark, re-run)
    if done.returncode:
        raise RuntimeError(f"bench dist: `{' '.join(argv)}` exited {done.returncode}; run it alone to see why")


def print_table(rows: list[Row]) -> None:
    """Print one line per setting.

    Args:
        rows: the settings' rows.
    """
    if not rows:
        return
    r0 = rows[0]
    print(f"\nmodel {r0.model} ({r0.params / 1e6:.1f}M params) on {r0.device_name}, {r0.dtype}, {r0.groups} groups x "
          f"{r0.n} rows, prompt {r0.prompt_tokens} + completion {r0.tokens}, "
          f"{'shared prefix' if r0.shared_prefix else 'packed'}{', grad ckpt' if r0.gradient_checkpointing else ''}, "
          f"{r0.threads} threads/rank")
    print(f"{'world':>5} {'step s':>8} {'min-max':>13} {'tok/s':>9} {'peak GiB/rank':>15} {'MFU':>6} "
          f"{'moved':>6} {'max|d| master':>13} {'bf16 diff':>9} {'planes':>12}")
    for r in rows:
        peaks = "/".join(f"{p:.2f}" for p in r.peak_gib)
        mf = f"{100 * r.mfu:5.1f}%" if r.mfu is not None else "-"
        delta = f"{r.max_abs_delta:.3g}" if r.max_abs_delta is not None else "-"
        planes = ("-" if r.planes_equal is None else
                  ",".join(f"{p}={'same' if ok else 'DIFF'}" for p, ok in r.planes_equal.items()))
        print(f"{r.world:5d} {r.step_s:8.3f} {r.step_s_min:6.3f}-{r.step_s_max:<6.3f} {r.tokens_per_s:9.1f} "
              f"{peaks:>15} {mf:>6} {100 * r.bf16_moved:5.1f}% {delta:>13} "
              f"{r.bf16_mismatch if r.bf16_mismatch is not None else '-':>9} {planes}")


def main(args: argparse.Namespace) -> int:
    """Run the benchmark (or this rank's part of it under torchrun) and print the table on rank 0.

    Args:
        args: parsed flags (see ``add_arguments``).
    """
    rows = [r for r in [run_ranks(args)] if r] if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 else run(args)
    if not args.child:
        print_table(rows)
    return 0
