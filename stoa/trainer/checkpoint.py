"""Trainer state in the bucket: a heavy checkpoint (master weights + AdamW) and a light per-step journal.

The journal (version, step, reuse counts) is written every step *before* the new version is
published, so a crash can only over-count a use, never let a record exceed the reuse cap.
The heavy checkpoint is written every ``checkpoint_every`` steps; on restart the trainer resumes
from it and continues the version sequence after the newest published pointer.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from stoa.bucket import Bucket, ObjectNotFound
from stoa.layout import checkpoint_key, journal_key


@dataclass
class Restored:
    """What a restart recovers."""

    version: int
    step: int


def save_checkpoint(bucket: Bucket, run_id: str, model: torch.nn.Module, opt: torch.optim.Optimizer,
                    *, version: int, step: int) -> int:
    """Write master weights and AdamW moments as one safetensors object; return its size in bytes.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        model: the policy model (fp32 master weights).
        opt: its AdamW optimizer.
        version: the published version these weights are.
        step: optimizer steps taken so far.
    """
    tensors: dict[str, torch.Tensor] = {}
    opt_steps: dict[str, float] = {}
    for name, p in model.named_parameters():
        tensors[f"param/{name}"] = p.detach().float().cpu().contiguous()
        st = opt.state.get(p, {})
        if "exp_avg" in st:
            tensors[f"exp_avg/{name}"] = st["exp_avg"].detach().cpu().contiguous()
            tensors[f"exp_avg_sq/{name}"] = st["exp_avg_sq"].detach().cpu().contiguous()
            opt_steps[name] = float(st["step"])
    meta = {"version": str(version), "step": str(step), "opt_steps": json.dumps(opt_steps)}
    fd, tmp = tempfile.mkstemp(suffix=".safetensors")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        size = os.path.getsize(tmp)
        bucket.put_file(checkpoint_key(run_id), tmp, create_only=False)
    finally:
        os.unlink(tmp)
    return size


def load_checkpoint(bucket: Bucket, run_id: str, model: torch.nn.Module,
                    opt: torch.optim.Optimizer) -> Restored | None:
    """Restore weights and optimizer state in place; ``None`` when the run has no checkpoint.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        model: the freshly loaded policy model.
        opt: its (fresh) optimizer.
    """
    fd, tmp = tempfile.mkstemp(suffix=".safetensors")
    os.close(fd)
    try:
        try:
            bucket.get_file(checkpoint_key(run_id), tmp)
        except ObjectNotFound:
            return None
        from safetensors import safe_open

        with safe_open(tmp, "pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(tmp)
    finally:
        os.unlink(tmp)
    opt_steps = json.loads(meta.get("opt_steps", "{}"))
    params = dict(model.named_parameters())
    if set(params) != {k.split("/", 1)[1] for k in tensors if k.startswith("param/")}:
        raise ValueError("trainer checkpoint does not match the model's parameters")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[f"param/{name}"].to(p.device))
            if name in opt_steps:
                opt.state[p] = {
                    "step": torch.tensor(opt_steps[name]),
                    "exp_avg": tensors[f"exp_avg/{name}"].to(p.device),
                    "exp_avg_sq": tensors[f"exp_avg_sq/{name}"].to(p.device),
                }
    return Restored(version=int(meta["version"]), step=int(meta["step"]))


def write_journal(bucket: Bucket, run_id: str, state: dict[str, Any]) -> None:
    """Overwrite the per-step journal.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        state: JSON-able trainer state (version, step, pool reuse counts).
    """
    bucket.put(journal_key(run_id), json.dumps(state, sort_keys=True).encode())


def read_journal(bucket: Bucket, run_id: str) -> dict[str, Any] | None:
    """Read the journal, or ``None`` if the run has none yet.

    Args:
        bucket: the run's bucket.
        run_id: the run.
    """
    try:
        return json.loads(bucket.get(journal_key(run_id)))
    except ObjectNotFound:
        return None
