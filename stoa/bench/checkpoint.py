"""Checkpoint time on the trainer step's path: written synchronously vs in the background.

Builds a trainer on a temporary local bucket twice (``checkpoint_async`` false, then true), and takes
``--checkpoints`` checkpoints, each after moving the weights (a stand-in step) and ``--step-seconds`` of waiting
(the next step, during which a background write runs). Prints, per mode, the seconds ``_Trainer.checkpoint``
held the step (median, min, max) and how long the last write took.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from stoa.config import TrainerConfig
from stoa.trainer import checkpoint as ckpt
from stoa.trainer.loop import _Trainer


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``stoa bench checkpoint``.

    Args:
        p: the subcommand's parser.
    """
    p.add_argument("--model", default="tiny", help="the policy (tiny, smollm2-135m, ...) [default: tiny]")
    p.add_argument("--checkpoints", type=int, default=8, help="checkpoints taken per mode [default: 8]")
    p.add_argument("--step-seconds", type=float, default=0.5,
                   help="waiting between checkpoints, standing in for a step [default: 0.5]")


def measure(root: str, model: str, background: bool, checkpoints: int, step_s: float) -> dict[str, float]:
    """One mode: seconds on the step's path per checkpoint, the last write's seconds, the checkpoint's bytes."""
    cfg = TrainerConfig(bucket=root, run="bench", model=model, task="toy", n_samples=2, eval_n=0, kl_beta=0.0,
                        checkpoint_async=background).validate()
    t = _Trainer(cfg, echo=lambda *_: None)
    try:
        t.resume()
        path: list[float] = []
        for k in range(1, checkpoints + 1):
            with torch.no_grad():  # a step moved the weights
                for p in t.policy.model.parameters():
                    p.add_(1e-3)
            t.version, t.step = k + 1, k
            t0 = time.perf_counter()
            t.checkpoint()
            path.append(time.perf_counter() - t0)
            time.sleep(step_s)
        t.settle_checkpoint()
        last = t.ops.writer.last
        ref = ckpt.read_pointer(t.bucket, "bench")
    finally:
        t.close()
    return {"median_s": statistics.median(path), "min_s": min(path), "max_s": max(path),
            "write_s": last.seconds if last else 0.0, "bytes": float(sum(ref.files.values()) if ref else 0)}


def main(args: argparse.Namespace) -> int:
    """Measure both modes and print one line each.

    Args:
        args: parsed flags (see ``add_arguments``).
    """
    print(f"checkpoint on the step's path, {args.model}, {args.checkpoints} checkpoints, "
          f"{args.step_seconds:g} s between them (local bucket, world size 1)")
    for background in (False, True):
        with tempfile.TemporaryDirectory(prefix="stoa-bench-ckpt-") as tmp:
            m = measure(f"{tmp}/b", args.model, background, args.checkpoints, args.step_seconds)
        mode = "background" if background else "synchronous"
        print(f"{mode:>12}: {m['median_s'] * 1e3:7.1f} ms on the path (min {m['min_s'] * 1e3:.1f}, max "
              f"{m['max_s'] * 1e3:.1f}); last write {m['write_s'] * 1e3:.1f} ms; {m['bytes'] / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    _p = argparse.ArgumentParser(description=__doc__)
    add_arguments(_p)
    raise SystemExit(main(_p.parse_args()))
