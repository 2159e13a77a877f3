"""``stoa bench pulse --lora-rank R``: bytes synced per version on the adapter plane vs the merged bf16 PULSE patch.

One LoRA policy takes ``--steps`` AdamW steps at one lr (the same samples and loss as the full benchmark); each
version is published twice into the local bucket, as the adapter plane's patch (``stoa.weights.adapter``: what a
LoRA run publishes) and as the merged weights' bf16 patch (what LoRA runs published before the adapter plane),
and synced by a worker of each, bit-exact checked against what was published.
"""

from __future__ import annotations

import argparse
import statistics
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from stoa.bucket import Bucket
from stoa.weights.adapter import adapter_state
from stoa.weights.planes import ADAPTER_PLANE, State, state_from_f32
from stoa.weights.publish import WeightPublisher
from stoa.weights.sync import WeightSync

from .sampler import Sampler
from .sweep import ANCHOR_EVERY

_PLANES = {"adapter": ADAPTER_PLANE, "merged": "bf16"}


def _states(policy: Any) -> dict[str, State]:
    """This version's state on each plane: the adapter's bf16 bits, and the merged weights' bf16 bits."""
    return {"adapter": adapter_state(policy.adapter_f32()), "merged": state_from_f32(policy.export_f32(), "bf16")}


def _same(a: State, b: State) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def bench_adapter(lr: float, args: argparse.Namespace, model_dir: Path, bucket: Bucket, sampler: Sampler,
                  emit: Callable[[dict[str, Any]], None], echo: Callable[[str], None]) -> dict[str, Any]:
    """Train a rank ``args.lora_rank`` adapter for ``args.steps`` steps at ``lr``; publish and sync every version on
    both planes; return the summary row (every step row goes to ``emit``).

    Args:
        lr: learning rate.
        args: parsed flags (``lora_rank``, ``lora_alpha``, ``steps``, ``seed``).
        model_dir: the model directory.
        bucket: the local bucket.
        sampler: prompts, sampling and the loss.
        emit: receives each JSONL row.
        echo: progress output.
    """
    import torch

    from stoa.models.lora_torch import LoraSpec
    from stoa.trainer.policy import Policy

    spec = LoraSpec(args.lora_rank, args.lora_alpha or 2.0 * args.lora_rank)
    policy = Policy(model_dir, torch.device("cpu"), lora=spec, seed=args.seed)
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=lr, weight_decay=0.0)
    tag = uuid.uuid4().hex[:8]
    pubs = {k: WeightPublisher(bucket, f"lora-{k}-{tag}", p, anchor_every=ANCHOR_EVERY) for k, p in _PLANES.items()}
    syncs = {k: WeightSync(bucket, f"lora-{k}-{tag}", p) for k, p in _PLANES.items()}
    states = _states(policy)
    anchors = {k: pubs[k].publish(1, states[k]).bytes_anchor for k in _PLANES}
    exact = all(_same(syncs[k].sync()[1], states[k]) for k in _PLANES)
    rows: list[dict[str, Any]] = []
    for step in range(1, args.steps + 1):
        sampler.step(policy, opt, step)
        states = _states(policy)
        row: dict[str, Any] = {"kind": "lora_step", "lr": lr, "rank": spec.rank, "step": step}
        for k in _PLANES:
            info = pubs[k].publish(step + 1, states[k])
            _, got = syncs[k].sync()
            exact = exact and _same(got, states[k]) and syncs[k].metrics["path"] == "patches"
            row.update({f"{k}_patch_bytes": info.bytes_patch, f"{k}_synced_bytes": syncs[k].metrics["bytes"],
                        f"{k}_changed": info.changed, f"{k}_elements": info.elements})
        row["ratio"] = row["adapter_synced_bytes"] / max(1, row["merged_synced_bytes"])
        rows.append(row)
        emit(row)
        echo(f"[bench pulse] lora r{spec.rank} lr {lr:g} step {step}: adapter {row['adapter_synced_bytes']:,} B, "
             f"merged bf16 {row['merged_synced_bytes']:,} B (ratio {row['ratio']:.4f})")
    summary = {"kind": "lora_summary", "model": args.model, "lr": lr, "rank": spec.rank, "alpha": spec.alpha,
               "steps": args.steps, "bit_identical": exact, "adapter_anchor_bytes": anchors["adapter"],
               "merged_anchor_bytes": anchors["merged"],
               "adapter_bytes_median": statistics.median(r["adapter_synced_bytes"] for r in rows),
               "merged_bytes_median": statistics.median(r["merged_synced_bytes"] for r in rows)}
    summary["ratio_median"] = summary["adapter_bytes_median"] / max(1, summary["merged_bytes_median"])
    emit(summary)
    return summary


def lora_lines(summaries: list[dict[str, Any]]) -> list[str]:
    """One line per lr: the median bytes synced per version on each plane, their ratio, bit-exactness.

    Args:
        summaries: :func:`bench_adapter`'s rows.
    """
    return [f"LoRA r{s['rank']} (alpha {s['alpha']:g}) {s['model']} lr {s['lr']:g}, {s['steps']} steps: bytes synced "
            f"per version, adapter plane {s['adapter_bytes_median']:,.0f} vs merged bf16 PULSE "
            f"{s['merged_bytes_median']:,.0f} = 1/{1 / max(s['ratio_median'], 1e-12):.1f}; anchors "
            f"{s['adapter_anchor_bytes']:,} vs {s['merged_anchor_bytes']:,} B; bit-identical: "
            f"{'yes' if s['bit_identical'] else 'NO'}" for s in summaries]
