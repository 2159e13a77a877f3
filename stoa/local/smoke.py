"""``stoa local smoke``: load the model object, report it, and fail unless only LoRA adapters are trainable."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stoa.local.backend import Backend, ModelSummary

SMOKE_MESSAGES = ({"role": "user", "content": "What is 2 + 2?"},)


class TrainableLeafError(RuntimeError):
    """A trainable parameter that is not a LoRA adapter matrix (the base must be frozen)."""


def check_only_adapters(summary: ModelSummary) -> None:
    """Raise ``TrainableLeafError`` listing trainable leaves other than ``lora_a`` / ``lora_b``.

    Args:
        summary: the backend's model summary.
    """
    if summary.trainable_params == 0 or not summary.trainable_names:
        raise TrainableLeafError("no trainable parameters: the LoRA adapters are missing")
    bad = summary.non_adapter_trainable()
    if bad:
        shown = ", ".join(bad[:8]) + (f" (+{len(bad) - 8} more)" if len(bad) > 8 else "")
        raise TrainableLeafError(f"{len(bad)} trainable leaves are not LoRA adapters: {shown}")


def _targets_lines(targets: list[list[str]]) -> list[str]:
    """Per-layer targets, runs of identical layers folded ('layers 0-29: q_proj, ...')."""
    lines, start = [], 0
    for i in range(1, len(targets) + 1):
        if i == len(targets) or targets[i] != targets[start]:
            span = f"layer {start}" if i - 1 == start else f"layers {start}-{i - 1}"
            names = ", ".join(p.rsplit(".", 1)[-1] if p.count(".") <= 1 else p for p in targets[start])
            lines.append(f"  {span}: {names} ({len(targets[start])})")
            start = i
    return lines


def smoke_report(backend: Backend, prompt_ids: list[int], echo: Callable[[str], Any] = print) -> ModelSummary:
    """Print the model object's report and check that only adapters train.

    Args:
        backend: the built model.
        prompt_ids: token ids of a short prompt for the logits-shape forward.
        echo: where lines go.

    Raises:
        TrainableLeafError: when a non-adapter leaf is trainable (after printing the report).
    """
    s = backend.summary
    echo(f"model_id:          {s.model_id}")
    echo(f"backend:           {s.backend} ({', '.join(f'{k} {v}' for k, v in s.extra.items())})")
    echo(f"layers:            {s.layers}")
    echo(f"quant_bits:        {s.quant_bits} ({s.quantized_linears} quantized linears)")
    echo("lora_targets per layer:")
    for line in _targets_lines(s.targets_per_layer):
        echo(line)
    echo(f"total_params:      {s.total_params:,}")
    echo(f"trainable_params:  {s.trainable_params:,} ({100 * s.trainable_params / max(s.total_params, 1):.3f}%)")
    echo(f"logits_shape:      {backend.logits_shape(prompt_ids)}")
    check_only_adapters(s)
    echo(f"trainable leaves:  {len(s.trainable_names)}, all LoRA adapters (lora_a, lora_b)")
    return s
