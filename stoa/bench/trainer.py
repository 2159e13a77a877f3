"""Trainer step benchmark: seconds and tokens/s for B groups x n samples, shared-prefix vs packed."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from stoa.algorithms import AlgoConfig, get_algorithm
from stoa.config.text import deprecated_flag, dtype_value
from stoa.config.trainer import LORA_BASE_PLANES, LORA_TARGETS
from stoa.models.random_llama import resolve_bench_model
from stoa.models.shapes import shape_from_dir
from stoa.rollouts.records import RolloutRecord, Sample
from stoa.trainer.peak import Workload, estimate_peak, is_cuda
from stoa.trainer.pool import Entry
from stoa.weights.planes import QUANT_BITS


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``stoa bench trainer``.

    Args:
        p: the subcommand's parser.
    """
    p.add_argument("--model", default="smollm2-135m", help="model name or path [default: smollm2-135m]")
    p.add_argument("--groups", type=int, default=8, help="groups per step (B) [default: 8]")
    p.add_argument("--n-samples", dest="n", metavar="N", type=int, default=8, help="samples per group [default: 8]")
    deprecated_flag(p, "--n", "--n-samples")
    p.add_argument("--prompt-tokens", type=int, default=48, help="prompt length [default: 48]")
    p.add_argument("--max-new-tokens", dest="tokens", metavar="N",
                   type=int, default=64, help="completion length [default: 64]")
    deprecated_flag(p, "--tokens", "--max-new-tokens")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per mode [default: 3]")
    p.add_argument("--modes", default="shared,packed", help="comma list of shared,packed [default: both]")
    p.add_argument("--algorithm", default="grpo", help="algorithm [default: grpo]")
    p.add_argument("--kl-beta", type=float, default=0.0, help="KL coefficient (>0 adds the reference forward)")
    p.add_argument("--micro-batch", type=int, default=16, help="packed-mode micro-batch [default: 16]")
    p.add_argument("--device", default="auto", help="torch device [default: auto]")
    p.add_argument("--out", default="", help="append JSONL rows to this file")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="train a LoRA adapter of this rank on the frozen base, default targets (0 = full "
                        "fine-tuning) [default: 0]")
    p.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA alpha [default: 32]")
    p.add_argument("--lora-base-plane", default="", choices=LORA_BASE_PLANES,
                   help="hold the LoRA base quantized as this weights plane (the trainer's lora_base_plane; "
                        "'' = the compute dtype) [default: '']")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    p.add_argument("--preflight", action="store_true",
                   help="compare the memory preflight's estimate with the measured peak of PREFLIGHT_GRID's "
                        "settings (packed mode, each in a fresh process)")
    p.add_argument("--dtype", default="float32", type=dtype_value, choices=("float32", "bfloat16"),
                   help="our Policy's compute dtype [default: float32]")
    p.add_argument("--compute-weights", default="bf16_copy", choices=("autocast", "bf16_copy"),
                   help="how a bfloat16 policy computes: autocast on the fp32 masters, or a bf16 copy of them "
                        "(the trainer's compute_weights) [default: bf16_copy]")


def synthetic_entries(groups: int, n: int, prompt_tokens: int, tokens: int, vocab: int, seed: int) -> list:
    """Random groups of the given shape as the pool hands them to the step (behaviour logprobs -2.0: see ``on_policy``).

    Args:
        groups: groups.
        n: samples per group.
        prompt_tokens: prompt length.
        tokens: completion length.
        vocab: token ids are drawn below it.
        seed: random seed.
    """

    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(10, vocab, size=prompt_tokens).astype(np.int32)
        samples = [Sample(rng.integers(10, vocab, size=tokens).astype(np.int32),
                          np.full(tokens, -2.0, np.float32), float(rng.random()), "length") for _ in range(n)]
        rec = RolloutRecord("bench", g, 1, "f", "bench", f"train:{g}", prompt, samples)
        out.append(Entry(f"k{g}", rec, np.array([s.reward for s in samples], np.float32)))
    return out


def policy_kwargs(dtype: str, compute_weights: str = "bf16_copy") -> dict[str, Any]:
    """Our Policy's dtype keywords for ``--dtype`` (``compute_dtype``) and ``--compute-weights``, checked against its
    signature.

    Args:
        dtype: ``float32`` or ``bfloat16``.
        compute_weights: ``autocast`` or ``bf16_copy`` (bf16 only; an older Policy without the keyword autocasts,
            whatever it says).
    """

    import torch

    from stoa.trainer.policy import Policy

    if dtype in ("float32", "fp32"):
        return {}
    if "compute_dtype" not in inspect.signature(Policy).parameters:
        raise ValueError("--dtype bfloat16: this stoa's Policy has no compute_dtype; run --dtype float32")
    if "compute_weights" not in inspect.signature(Policy).parameters:
        return {"compute_dtype": torch.bfloat16}
    return {"compute_dtype": torch.bfloat16, "compute_weights": compute_weights}


def reference(policy: Any, model_dir: Any, kl_beta: float, **dtype: Any) -> Any:
    """The KL's reference for ``policy``, as the fleet trainer holds it: None at ``kl_beta`` 0, a LoRA policy's own
    base with the adapters off (``BaseView``, no second model), else a frozen ``Policy`` of ``model_dir``.

    Args:
        policy: the trained policy.
        model_dir: the model directory (a full fine-tune's reference loads it again).
        kl_beta: the KL coefficient.
        **dtype: the policy's dtype keywords (``policy_kwargs``).
    """
    from stoa.trainer.policy import BaseView, Policy

    if kl_beta <= 0:
        return None
    if policy.lora is not None:
        return BaseView(policy)
    return Policy(model_dir, policy.device, trainable=False, **dtype)


def on_policy(entries: list[Any], policy: Any, tokens: int) -> list[Any]:
    """The entries with each sample's behaviour logprobs set to the policy's own (as TRL's single-iteration GRPO
    has it: ratio 1). With made-up logprobs the clipped ratio zeroes nearly every gradient, and AdamW on ~1e-20
    gradients runs on denormal floats, several times slower on x86.

    Args:
        entries: synthetic groups (:func:`synthetic_entries`).
        policy: our Policy.
        tokens: completion length.
    """

    import torch

    out = []
    with torch.no_grad():
        for e in entries:
            rec = e.record
            lp = policy.group_logprobs(rec.prompt_tokens, [s.tokens for s in rec.samples], tokens).float().cpu().numpy()
            samples = [dataclasses.replace(s, logprobs=lp[i, :len(s.tokens)].astype("float32"))
                       for i, s in enumerate(rec.samples)]
            out.append(dataclasses.replace(e, record=dataclasses.replace(rec, samples=samples)))
    return out


def main(args: argparse.Namespace) -> int:
    """Time optimizer steps on synthetic groups of the requested shape; print a table.

    Args:
        args: parsed flags (see ``add_arguments``).
    """
    if args.preflight:
        return preflight(args)
    import torch

    from stoa.engines.torch import resolve_device
    from stoa.models.lora_torch import LoraSpec
    from stoa.trainer.policy import Policy
    from stoa.trainer.step import train_step

    device = resolve_device(args.device)
    model_dir = resolve_bench_model(args.model)
    dtype = policy_kwargs(args.dtype, args.compute_weights)
    lora = LoraSpec(args.lora_rank, args.lora_alpha) if args.lora_rank > 0 else None
    policy = Policy(model_dir, device, gradient_checkpointing=args.gradient_checkpointing, lora=lora,
                    base_plane=args.lora_base_plane, **dtype)
    ref = reference(policy, model_dir, args.kl_beta, **dtype)
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-6)
    algo = get_algorithm(AlgoConfig.from_dict({"name": args.algorithm, "kl_beta": args.kl_beta,
                                               "max_tokens": args.tokens}), "torch")
    tokens_per_step = args.groups * args.n * args.tokens
    print(f"model {args.model} on {device}, {args.groups} groups x {args.n} samples, prompt {args.prompt_tokens} "
          f"+ completion {args.tokens} tokens ({tokens_per_step} trained tokens/step), "
          f"threads {torch.get_num_threads()}, compute {args.dtype}"
          + (f" ({args.compute_weights}), " if args.dtype == "bfloat16" else ", ")
          + (f"LoRA r={args.lora_rank} alpha={args.lora_alpha:g} base {args.lora_base_plane or 'float'}" if lora
             else "full fine-tuning"))
    rows = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        times = []
        for r in range(args.repeats + 1):  # the first step warms up and is not counted
            raw = synthetic_entries(args.groups, args.n, args.prompt_tokens, args.tokens, policy.vocab_size, r)
            entries = on_policy(raw, policy, args.tokens)  # made-up logprobs clip every ratio: denormal AdamW
            t0 = time.perf_counter()
            train_step(policy, ref, opt, algo, entries, current_version=1, micro_batch=args.micro_batch,
                       grad_clip=1.0, shared_prefix=(mode == "shared"),
                       recompute_limit=float("inf"))  # synthetic records: no worker's logprobs to judge
            if device.type == "cuda":
                torch.cuda.synchronize()
            if r:
                times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        row = {"bench": "trainer", "mode": mode, "model": args.model, "dtype": args.dtype, "groups": args.groups,
               "compute_weights": args.compute_weights if args.dtype == "bfloat16" else "",
               "lora_rank": args.lora_rank, "lora_base_plane": args.lora_base_plane if lora else "",
               "n": args.n,
               "prompt_tokens": args.prompt_tokens, "tokens": args.tokens, "step_s_median": med,
               "step_s_min": min(times), "step_s_max": max(times), "tokens_per_s": tokens_per_step / med,
               "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
               "peak_cuda_gb": torch.cuda.max_memory_reserved() / 1e9 if device.type == "cuda" else 0.0}
        rows.append(row)
    print(f"\n{'mode':8} {'step s (median)':>16} {'min-max':>14} {'trained tok/s':>14} {'peak RSS GB':>12}")
    for r in rows:
        print(f"{r['mode']:8} {r['step_s_median']:16.2f} {r['step_s_min']:6.2f}-{r['step_s_max']:<7.2f} "
              f"{r['tokens_per_s']:14.1f} {r['peak_rss_gb']:12.2f}")
    if len(rows) == 2:
        print(f"\nshared-prefix speed-up: {rows[1]['step_s_median'] / rows[0]['step_s_median']:.2f}x")
    if args.out:
        with Path(args.out).open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


PREFLIGHT_GRID = ((16, False, 0.0), (4, False, 0.0), (16, True, 0.0), (16, False, 0.04))
"""(micro_batch, gradient_checkpointing, kl_beta) settings that ``--preflight`` measures."""


def preflight_estimate(model: str, device: str, micro_batch: int, prompt_tokens: int, tokens: int, *,
                       gradient_checkpointing: bool = False, kl: bool = False, bf16: bool = True,
                       compute_weights: str = "bf16_copy", lora_rank: int = 0, lora_base_plane: str = "") -> Any:
    """``estimate_peak`` for one ``stoa bench trainer`` setting (one rank, packed), the preflight's figure.

    Args:
        model: the model name or directory.
        device: the torch device (CUDA counts the allocator, CPU the process).
        micro_batch: rows per forward.
        prompt_tokens: prompt tokens per row.
        tokens: completion tokens per row.
        gradient_checkpointing: whether activations are recomputed.
        kl: whether a frozen reference is held.
        bf16: whether the step computes in bf16.
        compute_weights: ``bf16_copy`` or ``autocast``, for a bf16 full fine-tune.
        lora_rank: the adapter's rank (0: full fine-tuning).
        lora_base_plane: the LoRA base's quantized plane ('': the compute dtype).
    """
    shape = shape_from_dir(resolve_bench_model(model), model)
    work = Workload(micro_batch, prompt_tokens, tokens, gradient_checkpointing, kl, 1, is_cuda(device), bf16=bf16,
                    lora_rank=lora_rank, lora_targets=tuple(LORA_TARGETS.split(",")) if lora_rank else (),
                    bf16_copy=bf16 and compute_weights == "bf16_copy", lean=not gradient_checkpointing,
                    lora_base_bits=QUANT_BITS.get(lora_base_plane, 0) if lora_rank else 0)
    return estimate_peak(shape, work)


def preflight(args: argparse.Namespace) -> int:
    """Run each ``PREFLIGHT_GRID`` setting as its own ``stoa bench trainer`` process (a peak is per process) and
    print its measured peak (CPU: RSS; CUDA: the allocator's reserved peak) next to ``estimate_peak``'s.

    Args:
        args: parsed flags (model, groups, n, prompt and completion tokens, device).
    """


    rows = args.groups * args.n
    print(f"model {args.model}, {rows} rows, prompt {args.prompt_tokens} + completion {args.tokens} tokens")
    print(f"{'micro':>5} {'ckpt':>5} {'kl':>5} {'measured GB':>12} {'estimated GB':>13}  parts")
    for micro, ckpt, kl in PREFLIGHT_GRID:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "row.jsonl"
            cmd = [sys.executable, "-m", "stoa", "bench", "trainer", "--model", args.model, "--groups",
                   str(args.groups), "--n", str(args.n), "--prompt-tokens", str(args.prompt_tokens), "--tokens",
                   str(args.tokens), "--modes", "packed", "--repeats", "1", "--micro-batch", str(micro),
                   "--kl-beta", str(kl), "--device", args.device, "--dtype", args.dtype, "--out", str(out),
                   "--compute-weights", args.compute_weights,
                   "--lora-rank", str(args.lora_rank), "--lora-alpha", str(args.lora_alpha),
                   "--lora-base-plane", args.lora_base_plane]
            subprocess.run(cmd + (["--gradient-checkpointing"] if ckpt else []), check=True, capture_output=True)
            row = json.loads(out.read_text().splitlines()[-1])
        est = preflight_estimate(args.model, args.device, min(micro, rows), args.prompt_tokens, args.tokens,
                                 gradient_checkpointing=ckpt, kl=kl > 0, bf16=args.dtype == "bfloat16",
                                 compute_weights=args.compute_weights, lora_rank=args.lora_rank,
                                 lora_base_plane=args.lora_base_plane)
        measured = row["peak_cuda_gb"] or row["peak_rss_gb"]
        print(f"{micro:5d} {ckpt!s:>5} {kl:5.2f} {measured:12.2f} {est.total:13.2f}  {est.describe()}")
    return 0
