"""The PULSE benchmark's learning-rate sweep: for one lr, AdamW steps from the initial weights, each version
published and synced through a local bucket, one JSONL row per step and a summary."""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from stoa.bucket import Bucket
from stoa.weights.planes import State, bf16_bits_to_f32, f32_to_bf16_bits, state_from_f32
from stoa.weights.publish import WeightPublisher
from stoa.weights.pulse import default_threads

from .sampler import Sampler
from .stats import bf16_flip_model, count_changed, magnitude_quantiles, timed
from .timing import CatchUp, Held, Runs, VersionTiming, catch_ups, first_sync, time_version

ANCHOR_EVERY = 1_000_000_000
"""The patch run's anchor cadence: only the first publish (the initial weights) is an anchor."""
WEIGHT_DECAY = 0.0
"""AdamW weight decay, the trainer's default (``TrainerConfig.weight_decay``)."""
BEHIND = 3
"""How many versions behind the "patches" catch-up worker is."""


@dataclass
class Trainer:
    """The trainer side of one lr: the policy, its AdamW optimizer and the patch run's publisher."""

    policy: Any
    opt: Any
    publisher: WeightPublisher
    load_s: float
    """Seconds to load the policy and build the optimizer."""


class Weights(NamedTuple):
    """The trainer's weights at one version: the stored plane state and the fp32 master weights."""

    state: State
    f32: dict[str, np.ndarray]


class Sizes(NamedTuple):
    """Bytes of the stored state and of the model in bf16 (the yardsticks of every ratio)."""

    state_bytes: int
    full_bf16_bytes: int


def bench_lr(lr: float, args: argparse.Namespace, model_dir: Path, bucket: Bucket, sampler: Sampler,
             emit: Callable[[dict[str, Any]], None], echo: Callable[[str], None]) -> dict[str, Any]:
    """Train ``args.steps`` AdamW steps at ``lr`` from the initial weights; publish and sync each version.

    Returns the summary row (medians over steps, catch-up timings); every step row goes to ``emit``.

    Args:
        lr: learning rate.
        args: parsed flags (model, steps, plane, repeat, ...).
        model_dir: the model directory.
        bucket: the local bucket both runs (patches and full anchors) are published to.
        sampler: prompts, sampling and the loss.
        emit: receives each JSONL row.
        echo: progress output.
    """
    tag = uuid.uuid4().hex[:8]
    run_id = f"pulse-{args.plane}-{tag}"
    runs = Runs(bucket, run_id, f"{run_id}-full", args.plane, args.repeat)
    trainer = _start(lr, args, model_dir, runs)
    f32 = trainer.policy.export_f32()
    state = state_from_f32(f32, runs.plane)
    first = trainer.publisher.publish(1, state)
    sizes = Sizes(sum(v.nbytes for v in state.values()), sum(2 * v.size for v in f32.values()))
    mags = magnitude_quantiles(f32)
    # The worker one version behind, and the one that stays BEHIND versions behind for the catch-up test.
    held, bit_ok = first_sync(runs, state, first.state_hash)
    behind_at = max(1, args.steps + 1 - BEHIND)
    lagging = held
    rows: list[dict[str, Any]] = []
    # On CPU export_f32() returns views of the live parameters, so keep a copy of the pre-step weights.
    prev = Weights(state, _copy(f32))
    for step in range(1, args.steps + 1):
        row, now, held = _step(lr, args, step, trainer, runs, sampler, prev, held, sizes)
        rows.append(row)
        emit(row)
        echo(_progress(lr, args.steps, row))
        bit_ok = bit_ok and row["bit_identical"]
        if step + 1 == behind_at:
            lagging = held
        prev = Weights(now.state, _copy(now.f32) if step < args.steps else now.f32)
    target = trainer.publisher.pointer
    assert target is not None
    catch = catch_ups(runs, lagging, prev.state, target.state_hash)
    bit_ok = bit_ok and all(c.ok for c in catch.values())
    summary = _summary(args, lr, rows, sizes, catch, args.steps + 1 - (lagging.version or 0), bit_ok) | {
        "load_s": trainer.load_s, "weight_magnitudes": mags}
    emit(summary)
    del trainer
    return summary


def _start(lr: float, args: argparse.Namespace, model_dir: Path, runs: Runs) -> Trainer:
    """Load the policy (rounded to bf16 first under ``--init bf16``), its optimizer and the publisher.

    Args:
        lr: learning rate.
        args: parsed flags (``init``).
        model_dir: the model directory.
        runs: where the publisher writes.
    """
    import torch

    from stoa.trainer.policy import Policy

    t0 = time.perf_counter()
    policy = Policy(model_dir, torch.device("cpu"))
    if args.init == "bf16":
        policy.load_f32({k: bf16_bits_to_f32(f32_to_bf16_bits(v)) for k, v in policy.export_f32().items()})
    opt = torch.optim.AdamW(policy.model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    load_s = time.perf_counter() - t0
    publisher = WeightPublisher(runs.bucket, runs.run_id, runs.plane, anchor_every=ANCHOR_EVERY)
    return Trainer(policy, opt, publisher, load_s)


def _step(lr: float, args: argparse.Namespace, step: int, trainer: Trainer, runs: Runs, sampler: Sampler,
          prev: Weights, held: Held, sizes: Sizes) -> tuple[dict[str, Any], Weights, Held]:
    """One AdamW step, then publish and time the new version; return its row, weights and worker after.

    Args:
        lr: learning rate.
        args: parsed flags.
        step: step index (the version published is ``step + 1``).
        trainer: policy, optimizer and publisher.
        runs: the runs of this lr.
        sampler: prompts, sampling and the loss.
        prev: the weights before the step (a copy of the fp32 masters).
        held: the worker one version behind.
        sizes: the byte yardsticks.
    """
    version = step + 1
    train = sampler.step(trainer.policy, trainer.opt, step)
    t = time.perf_counter()
    f32 = trainer.policy.export_f32()
    export_s = time.perf_counter() - t
    cast_s, state = timed(lambda: state_from_f32(f32, runs.plane), 1)
    vt = time_version(runs, trainer.publisher, version, prev.state, state, held)
    now = Weights(state, f32)
    row = _step_row(args, lr, step, vt, prev, now, sizes) | {"export_s": export_s, "cast_s": cast_s, **train}
    if runs.plane == "bf16":
        row["flip_model"] = bf16_flip_model(prev.f32, f32, lr)
    return row, now, vt.held


def _step_row(args: argparse.Namespace, lr: float, step: int, vt: VersionTiming, prev: Weights, now: Weights,
              sizes: Sizes) -> dict[str, Any]:
    """The JSONL row of one step: what changed, sizes, throughput, sync times and bit-exactness.

    Args:
        args: parsed flags.
        lr: learning rate.
        step: step index.
        vt: the version's publish and sync figures.
        prev: the weights before the step.
        now: the weights after it.
        sizes: the byte yardsticks.
    """
    kinds = count_changed(prev.state, now.state)
    changed = sum(c for c, _ in kinds.values())
    values = sum(n for _, n in kinds.values())
    sb = sizes.state_bytes
    return {
        "kind": "step", "model": args.model, "plane": args.plane, "lr": lr, "init": args.init, "step": step,
        "version": step + 1,
        "params": vt.pub.elements if args.plane == "bf16" else sum(v.size for v in now.f32.values()),
        "values": values, "changed_values": changed, "changed_frac": changed / values,
        "changed_frac_by_kind": {k: c / n for k, (c, n) in sorted(kinds.items())},
        "patch_positions": vt.info.changed, "patch_bytes": vt.pub.bytes_patch,
        "full_bytes": vt.full_pub.bytes_anchor, "full_bf16_bytes": sizes.full_bf16_bytes,
        "ratio": vt.full_pub.bytes_anchor / vt.pub.bytes_patch, "state_bytes": sb,
        "encode_s": vt.encode_s, "encode_gbps": sb / vt.encode_s / 1e9,
        "apply_s": vt.apply_s, "apply_gbps": sb / vt.apply_s / 1e9,
        "encode_apply_gbps": sb / (vt.encode_s + vt.apply_s) / 1e9,
        "encode_cpu_s": vt.encode_cpu_s, "apply_cpu_s": vt.apply_cpu_s,
        "encode_apply_cpu_gbps": sb / (vt.encode_cpu_s + vt.apply_cpu_s) / 1e9,
        "loadavg_1m": os.getloadavg()[0],
        "sync1_s": vt.sync_s, "full_sync_s": vt.full_sync_s, "publish_s": vt.pub.seconds,
        "full_publish_s": vt.full_pub.seconds, "threads": default_threads(), "bit_identical": vt.identical,
    }


def _progress(lr: float, steps: int, row: Mapping[str, Any]) -> str:
    """The progress line of one step."""
    return (f"  lr={lr:g} step {row['step']}/{steps}: changed {100 * row['changed_frac']:.3f}%, patch "
            f"{row['patch_bytes'] / 1e6:.2f} MB (x{row['ratio']:.1f}), encode {row['encode_gbps']:.2f} GB/s, "
            f"apply {row['apply_gbps']:.2f} GB/s, sync {row['sync1_s']:.2f} s, "
            f"full sync {row['full_sync_s']:.2f} s, "
            f"train step {row['train_step_s']:.1f} s, bit-identical {row['bit_identical']}")


def _summary(args: argparse.Namespace, lr: float, rows: list[dict[str, Any]], sizes: Sizes,
             catch: Mapping[str, CatchUp], behind: int, bit_ok: bool) -> dict[str, Any]:
    """The summary row of one lr: medians over its steps, catch-up figures and overall bit-exactness.

    Args:
        args: parsed flags.
        lr: learning rate.
        rows: its step rows.
        sizes: the byte yardsticks.
        catch: the catch-up figures (``patches``, ``anchor``, ``full``).
        behind: how many versions the patches catch-up worker was behind.
        bit_ok: whether every path reproduced the trainer's bits.
    """
    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    mean_patch = statistics.fmean(r["patch_bytes"] for r in rows)
    full_bytes = rows[0]["full_bytes"]
    summary: dict[str, Any] = {
        "kind": "summary", "model": args.model, "plane": args.plane, "lr": lr, "steps": args.steps,
        "init": args.init, "params": rows[0]["params"], "state_bytes": sizes.state_bytes,
        "full_bytes": full_bytes, "full_bf16_bytes": sizes.full_bf16_bytes, "mean_patch_bytes": mean_patch,
        "ratio": full_bytes / mean_patch,
        "ratio_vs_bf16": sizes.full_bf16_bytes / mean_patch,
        "changed_frac": med("changed_frac"), "changed_frac_steps": [r["changed_frac"] for r in rows],
        "patch_bytes_steps": [r["patch_bytes"] for r in rows],
        "catchup_behind": behind, "catchup_patches_s": catch["patches"].seconds,
        "catchup_patches_bytes": catch["patches"].bytes, "catchup_anchor_s": catch["anchor"].seconds,
        "catchup_anchor_bytes": catch["anchor"].bytes, "catchup_full_s": catch["full"].seconds,
        "catchup_full_bytes": catch["full"].bytes, "threads": default_threads(), "repeat": args.repeat,
        "bit_identical": bit_ok,
    }
    for key in ("encode_gbps", "apply_gbps", "encode_apply_gbps", "encode_s", "apply_s", "encode_cpu_s",
                "apply_cpu_s", "encode_apply_cpu_gbps", "loadavg_1m", "sync1_s", "publish_s",
                "full_publish_s", "cast_s", "train_step_s"):
        summary[key] = med(key)
    if args.plane == "bf16":
        summary["flip_model_steps"] = [r["flip_model"] for r in rows]
    return summary


def _copy(named: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.array(v, copy=True) for k, v in named.items()}
