"""The in-process parts of ``stoa bench gpu``: PULSE from device tensors, and the fleet item's commands and
reading of its metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stoa.models.random_llama import resolve_bench_model
from stoa.telemetry.metrics import read_metrics
from stoa.weights.planes import f32_to_bf16_bits
from stoa.weights.pulse import apply_patch, encode_patch


@dataclass(frozen=True)
class PulseFigures:
    """What the PULSE item found."""

    tensors: int
    elements: int
    cast_mismatches: int
    """bf16 elements whose bits cast on the device differ from the CPU path's (``f32_to_bf16_bits``)."""
    patch_same: bool
    """Whether the patch encoded from the device-cast bits is byte-identical to the CPU path's."""
    applied_exact: bool
    """Whether applying the patch to the previous state gives the new state bit for bit (its hashes checked)."""
    engine_mismatches: int
    """Elements of a bf16 torch engine on the device that differ from the published bits after loading them."""
    patch_mb: float
    encode_s: float
    apply_s: float

    @property
    def ok(self) -> bool:
        """Every promise held."""
        return (self.cast_mismatches == 0 and self.patch_same and self.applied_exact
                and self.engine_mismatches == 0)


def device_bits(t: Any) -> np.ndarray:
    """A float tensor's bf16 bits, cast on its own device (round to nearest even), as a uint16 host array."""
    import torch

    return t.detach().to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)


def check_pulse(model: str, device: str) -> PulseFigures:
    """PULSE from device tensors: the trainer's masters on ``device``, a step that moves them, both states' bf16
    bits cast on the device and on the host, the patch from each, applied, and loaded into a bf16 torch engine.

    Args:
        model: the model (``llama-1b``, ``tiny``, ...).
        device: where the masters and the engine live.

    Returns:
        what held and how long encoding and applying took.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from stoa.engines.torch import TorchEngine

    model_dir = resolve_bench_model(model)
    masters: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    masters.to(device)
    params = dict(masters.named_parameters())
    before = {k: device_bits(p) for k, p in params.items()}
    before_host = {k: f32_to_bf16_bits(p.detach().cpu().numpy()) for k, p in params.items()}
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():  # a step: every weight moves by ~1e-3 of its scale, as an AdamW step at lr 1e-3 would
        for p in params.values():
            p.add_(torch.randn(p.shape, generator=gen, device=device) * 1e-3 * p.abs().mean().clamp(min=1e-6))
    after = {k: device_bits(p) for k, p in params.items()}
    host = {k: f32_to_bf16_bits(p.detach().cpu().numpy()) for k, p in params.items()}
    cast_bad = int(sum(int((after[k] != host[k]).sum() + (before[k] != before_host[k]).sum()) for k in params))
    t0 = time.perf_counter()
    patch = encode_patch(before, after, run_id="gpu", from_version=1, to_version=2, plane="bf16")
    encode_s = time.perf_counter() - t0
    same = patch == encode_patch(before_host, host, run_id="gpu", from_version=1, to_version=2, plane="bf16")
    t0 = time.perf_counter()
    applied, _ = apply_patch(before, patch, run_id="gpu", expected_from_version=1, plane="bf16")
    apply_s = time.perf_counter() - t0
    exact = all(np.array_equal(applied[k], host[k]) for k in params)
    del masters
    engine = TorchEngine(model_dir, device=device, dtype="bfloat16")
    engine.load_state(applied, "bf16")
    loaded = dict(engine.model.named_parameters())
    engine_bad = int(sum(int((device_bits(loaded[k]) != host[k]).sum()) for k in params if k in loaded))
    return PulseFigures(len(params), int(sum(a.size for a in host.values())), cast_bad, same, exact, engine_bad,
                        len(patch) / 1e6, encode_s, apply_s)


def fleet_args(bucket: str, device: str, steps: int) -> tuple[list[str], list[str]]:
    """The trainer's and the worker's ``stoa`` arguments for the fleet item (tiny model, toy task, run ``gpu``).

    Args:
        bucket: a local bucket directory.
        device: both processes' torch device.
        steps: the trainer's steps.
    """
    trainer = ["trainer", "--bucket", bucket, "--run", "gpu", "--model", "tiny", "--task", "toy", "--device", device,
               "--n-samples", "4", "--groups-per-step", "4", "--max-new-tokens", "8", "--lr", "3e-2",
               "--eval-n", "0", "--kl-beta", "0", "--max-wait-seconds", "120", "--poll-seconds", "0.2",
               "--steps", str(steps)]
    worker = ["worker", "--bucket", bucket, "--run", "gpu", "--name", "w0", "--engine", "torch", "--device", device,
              "--groups-in-flight", "2", "--poll-seconds", "0.2", "--wait-seconds", "120"]
    return trainer, worker


WINDOW = 5
"""Steps averaged at each end of the fleet item's run (the toy task's reward is noisy step to step)."""


@dataclass(frozen=True)
class Learned:
    """The fleet item's reading of the trainer's metrics."""

    steps: int
    first: float
    """Mean reward of the first ``WINDOW`` steps."""
    last: float
    """Mean reward of the last ``WINDOW`` steps."""
    rejected: int
    """Records the trainer rejected (an honest worker on the same device: none)."""

    @property
    def ok(self) -> bool:
        """The reward rose by more than 0.05 and nothing was rejected."""
        return self.steps >= 2 * WINDOW and self.last > self.first + 0.05 and self.rejected == 0


def fleet_learned(metrics: Path) -> Learned:
    """Read the fleet item's trainer metrics.

    Args:
        metrics: the run's ``metrics/trainer.jsonl``.
    """
    rows = [r for r in read_metrics(metrics) if "train/loss" in r] if metrics.exists() else []
    rewards = [float(r["rollout/reward_mean"]) for r in rows]
    rejected = sum(int(v) for r in rows for k, v in r.items() if k.startswith("rollout/rejected/") and v)
    first = float(np.mean(rewards[:WINDOW])) if rewards else float("nan")
    last = float(np.mean(rewards[-WINDOW:])) if rewards else float("nan")
    return Learned(len(rows), first, last, rejected)
