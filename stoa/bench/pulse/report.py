"""The PULSE benchmark's printed report: the per-lr table, one note per lr, the goals and the summary line."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from stoa.weights.pulse import default_threads


def format_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """The per-lr table: sparsity, sizes, ratio, throughput, catch-up times and bit-exactness.

    Args:
        summaries: summary rows from :func:`stoa.bench.pulse.sweep.bench_lr`.
    """
    head = ("lr", "plane", "sparsity %", "patch MB", "full MB", "ratio", "encode GB/s", "apply GB/s",
            "catch-up s (patches / anchor / full)", "bit_identical")
    lines: list[tuple[str, ...]] = [head]
    for s in summaries:
        lines.append((
            f"{s['lr']:g}", s["plane"], f"{100 * s['changed_frac']:.3f}",
            f"{s['mean_patch_bytes'] / 1e6:.2f}", f"{s['full_bytes'] / 1e6:.1f}", f"{s['ratio']:.1f}",
            f"{s['encode_gbps']:.2f}", f"{s['apply_gbps']:.2f}",
            f"{s['catchup_patches_s']:.2f} / {s['catchup_anchor_s']:.2f} / {s['catchup_full_s']:.2f}",
            str(s["bit_identical"]).lower(),
        ))
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in lines)


def notes(summaries: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per lr (per-step sizes, CPU cost, catch-up bytes, publish and train times), then flip models.

    Args:
        summaries: summary rows, in lr order.
    """
    out = []
    for s in summaries:
        out.append(
            f"lr={s['lr']:g}: patch MB per step {[round(b / 1e6, 2) for b in s['patch_bytes_steps']]}, "
            f"changed % {[round(100 * f, 3) for f in s['changed_frac_steps']]}; "
            f"encode+apply {s['encode_apply_gbps']:.2f} GB/s wall, {s['encode_apply_cpu_gbps']:.2f} GB per "
            f"CPU-second (encode {s['encode_cpu_s']:.3f} + apply {s['apply_cpu_s']:.3f} CPU-s for "
            f"{s['state_bytes'] / 1e6:.0f} MB stored, {s['threads']} threads, "
            f"load average {s['loadavg_1m']:.1f}); catch-up bytes "
            f"{s['catchup_patches_bytes'] / 1e6:.1f} MB ({s['catchup_behind']} patches) / "
            f"{s['catchup_anchor_bytes'] / 1e6:.1f} MB (anchor + {s['steps']}) / "
            f"{s['catchup_full_bytes'] / 1e6:.1f} MB; WeightSync one version behind {s['sync1_s']:.2f} s; "
            f"trainer publish {s['publish_s']:.2f} s (patch) vs "
            f"{s['full_publish_s']:.2f} s (anchor), state_from_f32 {s['cast_s']:.2f} s; train step "
            f"{s['train_step_s']:.1f} s"
        )
        for i, m in enumerate(s.get("flip_model_steps", []), start=1):
            out.append(
                f"  step {i}: bf16 flips {100 * m['measured']:.3f}%; models: uniform(|d|=lr) "
                f"{100 * m['uniform_lr']:.3f}%, uniform(measured |d|) {100 * m['uniform_delta']:.3f}%, "
                f"position(|d|=lr) {100 * m['position_lr']:.3f}%; "
                f"mean |d|/lr {m['mean_abs_delta_over_lr']:.2f}; "
                f"masters before: on bf16 grid {100 * m['on_grid']:.1f}%, on a tie {100 * m['tie']:.2f}%"
            )
    return out



def report_lines(args: argparse.Namespace, summaries: Sequence[Mapping[str, Any]]) -> list[str]:
    """Everything ``stoa bench pulse`` prints on stdout; the last line is the summary of the first lr.

    Args:
        args: the benchmark's flags.
        summaries: summary rows from :func:`stoa.bench.pulse.sweep.bench_lr`, in lr order.
    """
    lines = [f"PULSE weight-plane benchmark: {args.model}, plane {args.plane}, init {args.init}, "
             f"{args.steps} AdamW steps per lr; medians over steps, each timing the median of {args.repeat} "
             f"runs; {default_threads()} PULSE threads; local bucket; full = the plane's anchor",
             format_table(summaries), *notes(summaries)]
    first = summaries[0]
    goals = [
        (f"ratio >= 100 (lr {first['lr']:g})", first["ratio"] >= 100),
        ("encode + apply >= 1 GB/s", first["encode_apply_gbps"] >= 1.0),
        ("100% bit-identical (all lrs)", all(s["bit_identical"] for s in summaries)),
    ]
    lines.append("goals: " + ", ".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in goals))
    lines.append(f"ratio={first['ratio']:.1f} encode_gbps={first['encode_gbps']:.2f} "
                 f"apply_gbps={first['apply_gbps']:.2f} bit_identical={str(first['bit_identical']).lower()}")
    return lines
