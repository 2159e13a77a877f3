"""Where the trainer step's time goes on a GPU: step time per setting, then a torch.profiler table of one step.

The GPU check's ``trainer`` item reports MFU and nothing more; this says why it is what it is. It runs the check's
shape (``llama-1b``, 8 groups x 8 rows, 128 + 256 tokens, packed, bf16 compute copy) through ``train_step`` in
this process and prints, for each setting (micro-batch, gradient checkpointing, AdamW ``foreach`` or ``fused``),
the median step and its MFU; then it profiles one step of the fastest setting and prints the ops with the most
device time, the device's busy time against the step's wall time (a gap is host overhead or synchronisation),
and the time spent inside ``optimizer.step``. ``--device cpu --model tiny`` rehearses it here. Usage::

    python benchmarks/cuda_profile.py --device cuda --out $OUT/profile.jsonl
    python benchmarks/cuda_profile.py --device cuda --micro-batches 64 --no-checkpointing-rows --compile also
    python benchmarks/cuda_profile.py --device cpu --model tiny --groups 2 --n 2 --prompt-tokens 16 --tokens 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
from torch.profiler import DeviceType

from stoa.algorithms import AlgoConfig, get_algorithm
from stoa.bench.dist import mfu, peak_bf16_flops
from stoa.bench.trainer import synthetic_entries
from stoa.models.random_llama import resolve_bench_model
from stoa.trainer.policy import Policy
from stoa.trainer.step import train_step


@dataclass(frozen=True)
class Setting:
    """One way of running the step."""

    micro_batch: int
    checkpointing: bool
    adamw: str  # "foreach" or "fused"
    compiled: bool = False  # each decoder layer of the computing module through torch.compile


@dataclass
class Result:
    """A setting's timings."""

    setting: Setting
    step_s: float
    mfu: float | None
    peak_gib: float


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_opt(policy: Policy, adamw: str) -> torch.optim.Optimizer:
    params = list(policy.trainable_parameters())
    if adamw == "fused":
        return torch.optim.AdamW(params, lr=1e-6, fused=True)
    return torch.optim.AdamW(params, lr=1e-6, foreach=True)


def one_step(policy: Policy, opt: torch.optim.Optimizer, args: argparse.Namespace, micro: int, seed: int) -> None:
    algo = get_algorithm(AlgoConfig.from_dict({"name": "grpo", "kl_beta": 0.0, "max_tokens": args.tokens}), "torch")
    entries = synthetic_entries(args.groups, args.n, args.prompt_tokens, args.tokens, policy.vocab_size, seed)
    train_step(policy, None, opt, algo, entries, current_version=1, micro_batch=micro, grad_clip=1.0,
               shared_prefix=False, recompute_limit=float("inf"))


def make_policy(s: Setting, args: argparse.Namespace, device: torch.device) -> Policy:
    """A bf16-copy policy under ``s``; ``compiled``: each decoder layer of the module that computes compiled
    (``torch.compile(dynamic=True)``: packed lengths vary), so its elementwise work (norms, SwiGLU, rotary, casts)
    can fuse."""
    policy = Policy(resolve_bench_model(args.model), device, gradient_checkpointing=s.checkpointing,
                    compute_dtype=torch.bfloat16)
    if s.compiled:
        root: Any = policy.copy.module if policy.copy is not None else policy.model
        layers: torch.nn.ModuleList = root.model.layers
        for i, layer in enumerate(layers):
            layers[i] = cast(torch.nn.Module, torch.compile(layer, dynamic=True))
    return policy


def time_setting(s: Setting, args: argparse.Namespace, device: torch.device) -> Result:
    """One warm-up (the compile, when compiled) and ``--repeats`` timed steps of a fresh policy under ``s``."""
    policy = make_policy(s, args, device)
    opt = make_opt(policy, s.adamw)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for r in range(args.repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        one_step(policy, opt, args, s.micro_batch, r)
        sync(device)
        if r:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    params = sum(p.numel() for p in policy.model.parameters())
    tokens = args.groups * args.n * (args.prompt_tokens + args.tokens)
    peak = peak_bf16_flops(torch.cuda.get_device_name(device), 0.0) if device.type == "cuda" else None
    gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    del opt, policy
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Result(s, step_s, mfu(params, tokens, step_s, peak, 1) if peak else None, gib)


def profile_step(s: Setting, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Profile one step (after a warm-up) under ``s``; print the top ops by device time and the busy fraction."""
    from torch.profiler import ProfilerActivity, profile

    policy = make_policy(s, args, device)
    opt = make_opt(policy, s.adamw)
    one_step(policy, opt, args, s.micro_batch, 0)
    sync(device)
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        one_step(policy, opt, args, s.micro_batch, 1)
        sync(device)
        wall = time.perf_counter() - t0
    avgs = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(avgs.table(sort_by=key, row_limit=args.top, max_name_column_width=60))
    # the ops' own device time (kernels are attributed to the op that launched them), as the table's footer sums it
    busy = sum(getattr(e, key, 0.0) for e in avgs if e.device_type == DeviceType.CPU) / 1e6
    opt_s = next((e.cpu_time_total / 1e6 for e in avgs if e.key.startswith("Optimizer.step")), 0.0)
    top = sorted(avgs, key=lambda e: -getattr(e, key, 0.0))[:args.top]
    return {"wall_s": wall, "device_busy_s": busy, "busy_fraction": busy / wall, "optimizer_step_s": opt_s,
            "top": [{"op": e.key, "self_s": getattr(e, key, 0.0) / 1e6, "calls": e.count} for e in top]}


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--micro-batches", default="16,64", help="comma-separated micro-batch sizes to time")
    p.add_argument("--compile", default="no", choices=("no", "also", "only"),
                   help="also (or only) time each setting with its decoder layers compiled [default: no]")
    p.add_argument("--no-checkpointing-rows", action="store_true", help="skip the gradient-checkpointing rows")
    p.add_argument("--top", type=int, default=20, help="ops in the profile table")
    p.add_argument("--out", default="", help="append JSONL rows here")
    args = p.parse_args()
    device = torch.device(args.device)
    adamws = ("foreach", "fused") if device.type == "cuda" else ("foreach",)
    compiled = {"no": (False,), "also": (False, True), "only": (True,)}[args.compile]
    ckpts = (False,) if args.no_checkpointing_rows else (True, False)
    settings = [Setting(mb, ck, a, c) for mb in (int(m) for m in args.micro_batches.split(","))
                for ck in ckpts for a in adamws for c in compiled]
    results = []
    for s in settings:
        r = time_setting(s, args, device)
        results.append(r)
        mfu_s = f"{r.mfu:.1%}" if r.mfu is not None else "-"
        tag = " compiled" if s.compiled else ""
        print(f"micro {s.micro_batch:3d} ckpt {s.checkpointing!s:5} adamw {s.adamw:7}{tag}: {r.step_s:.3f} s/step, "
              f"MFU {mfu_s}, peak {r.peak_gib:.1f} GiB", flush=True)
    best = min(results, key=lambda r: r.step_s)
    prof = profile_step(best.setting, args, device)
    print(f"profiled {best.setting}: wall {prof['wall_s']:.3f} s, device busy {prof['device_busy_s']:.3f} s "
          f"({prof['busy_fraction']:.0%}), optimizer.step {prof['optimizer_step_s']:.3f} s")
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            for r in results:
                f.write(json.dumps({"bench": "cuda_profile", **asdict(r)}) + "\n")
            f.write(json.dumps({"bench": "cuda_profile", "profile": prof, "setting": asdict(best.setting)}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
