"""The memory preflight's core, shared by the trainer and local mode: activations, the search for a fix, the report.

Each mode estimates its own peak from a ``ModelShape`` (``stoa.models.shapes``) and its settings (the trainer:
full fine-tuning per rank, ``stoa.trainer.peak``; local mode: QLoRA on one process, ``stoa.local.preflight``),
and names the knobs that shrink it. This module holds what both do alike: the activation model fitted on both
modes' measurements, ``check_fit`` (the estimate against the memory, then the first single knob setting that
fits, then the knobs together), ``FitReport`` and the one ``MemoryPreflightError``. Nothing here imports torch
or mlx.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from stoa.config.base import ConfigError
from stoa.models.shapes import ModelShape

__all__ = ["ACT_ATTN", "ACT_H", "ACT_I", "GB", "Candidate", "Estimate", "FitReport", "Fix", "MemoryPreflightError",
           "activation_bytes", "check_fit", "halvings", "lora_params", "quantized_base_bytes", "refuse"]

GB = 1e9
ACT_H, ACT_I, ACT_ATTN = 10.0, 5.0, 2.0
"""Saved values per token and layer in a backward: ACT_H x hidden + ACT_I x MLP width + ACT_ATTN x heads x S
attention scores (fitted to both modes' measurements on SmolLM2)."""

S = TypeVar("S")


def activation_bytes(shape: ModelShape, rows: int, seq: int, value_bytes: float, *, checkpointing: bool,
                     checkpoint_blocks: int, attention_share: bool = False) -> float:
    """Bytes of activations a forward keeps for backward: per layer, ``rows x seq`` tokens of ACT_H x hidden +
    ACT_I x the MLP width a token runs (MoE: top-k experts and a shared one) + ACT_ATTN x heads x seq values.

    With gradient checkpointing only the block inputs (layers x rows x seq x hidden) stay, plus
    ``checkpoint_blocks`` blocks' worth (the recomputed ones alive at the peak).

    Args:
        shape: the model's shape.
        rows: rows per forward (the micro-batch).
        seq: tokens per row (prompt and completion).
        value_bytes: bytes per saved value (4 fp32, 2 bf16; fitted figures in between).
        checkpointing: gradient checkpointing on.
        checkpoint_blocks: blocks' worth alive besides the block inputs when checkpointing (at most every layer).
        attention_share: scale the attention scores by the share of attention layers (a hybrid's conv and
            linear-attention layers keep none).
    """
    attn = ACT_ATTN * shape.heads * seq
    if attention_share:
        attn = attn * shape.attention_layers() / max(1, shape.layers)
    per_layer = rows * seq * (ACT_H * shape.hidden + ACT_I * shape.active_intermediate() + attn) * value_bytes
    if checkpointing:
        inputs = shape.layers * rows * seq * shape.hidden * value_bytes
        return inputs + min(checkpoint_blocks, shape.layers) * per_layer
    return shape.layers * per_layer


def lora_params(shape: ModelShape, rank: int, targets: Iterable[str]) -> int:
    """Parameters of a rank-``rank`` LoRA adapter: r x (in + out) for every linear of the decoder blocks whose
    path ends with one of ``targets`` (PEFT's suffix rule; routed experts are not linears, so never adapted).

    Args:
        shape: the model's shape.
        rank: the adapter's rank.
        targets: module-name suffixes (``q_proj``...).
    """
    ts = tuple(targets)
    return sum(rank * (i + o) for layer in range(shape.layers) for path, (i, o) in shape.layer_linears(layer).items()
               if any(path == t or path.endswith("." + t) for t in ts))


def quantized_base_bytes(n_quant: int, bits: int, group_size: int, scale_bytes: float) -> float:
    """Bytes of ``n_quant`` weights held quantized: ``bits`` per code plus a scale and a bias of ``scale_bytes``
    each per group of ``group_size`` (a fleet trainer's ``lora_base_plane``: bf16 scales, 2 bytes; local mode's
    torch base: float32 ones).

    Args:
        n_quant: the quantized weights.
        bits: 4 or 8.
        group_size: weights per scale.
        scale_bytes: bytes per scale (and per bias).
    """
    return n_quant * (bits / 8 + 2 * scale_bytes / group_size)


def halvings(value: int, floor: int = 1) -> list[int]:
    """A knob's candidate settings: ``value`` halved until ``floor``, ending at ``floor`` itself (nothing when
    ``value`` is at or below it).

    Args:
        value: the current setting.
        floor: the smallest setting worth trying.
    """
    out, v = [], value // 2
    while v >= floor:
        out.append(v)
        v //= 2
    if value > floor and (not out or out[-1] != floor):
        out.append(floor)
    return out


class Estimate(Protocol):
    """A mode's peak estimate: a total in GB and a one-line breakdown."""

    @property
    def total(self) -> float:
        """GB at the peak."""
        ...

    def describe(self) -> str:
        """One line: the total and its parts."""
        ...


E = TypeVar("E", bound=Estimate)


class MemoryPreflightError(ConfigError):
    """The estimate exceeds the memory; ``field`` names the knob that would make it fit (or what to change)."""


@dataclass(frozen=True)
class Candidate(Generic[S]):
    """One setting of a knob: its name, how the user sets it, and the workload it makes."""

    knob: str
    flags: str
    """How to set it, as the user writes it (``--micro-batch 4``, ``micro_batch = 4``)."""
    work: S


Knobs = Callable[[Any], Sequence[Sequence[Candidate[Any]]]]
"""A workload -> each knob's settings in order of preference (a knob's group: smallest change first; empty when
the knob cannot move)."""


@dataclass(frozen=True)
class Fix(Generic[S, E]):
    """A change that makes the estimate fit: the first knob it changes, how to set it all, the estimate after."""

    knob: str
    flags: str
    estimate: E
    available_gb: float
    work: S


@dataclass(frozen=True)
class FitReport(Generic[S, E]):
    """An estimate against the memory it may use, and the preferred fix when it does not fit."""

    estimate: E
    work: S
    """The workload estimated (the trainer: a ``Workload``; local mode: the ``LocalConfig``)."""
    available_gb: float
    source: str
    """Where ``available_gb`` came from."""
    fix: Fix[S, E] | None = None
    scope: str = ""
    """What the figures cover, after "estimated peak memory" (" per rank at 2 rank(s)")."""
    dead_end: str = ""
    """What to do when no knob fits."""
    refuse_as: str = "preflight"
    """The field a refusal names when no knob fits."""

    @property
    def fits(self) -> bool:
        """Whether the estimate is within the memory."""
        return self.estimate.total <= self.available_gb

    @property
    def knob(self) -> str | None:
        """The field a refusal names: the fix's knob, ``refuse_as`` when nothing fits, None when it fits."""
        if self.fits:
            return None
        return self.fix.knob if self.fix is not None else self.refuse_as

    @property
    def suggested(self) -> S | None:
        """The workload of the fix (None when it fits or nothing does)."""
        return None if self.fix is None else self.fix.work

    def message(self) -> str:
        """One line: the estimate against the memory, and the fix when it does not fit."""
        head = (f"estimated peak memory{self.scope} {self.estimate.describe()}; available {self.available_gb:.2f} GB"
                f" ({self.source})")
        if self.fits:
            return head + ": fits"
        if self.fix is None:
            return head + f": does not fit; {self.dead_end}"
        return head + f": does not fit; {self.fix.flags} would fit (estimate {self.fix.estimate.total:.2f} GB)"


def check_fit(work: S, estimate: Callable[[S], E], available: Callable[[S], float], knobs: Knobs, *,
              source: str, scope: str = "", dead_end: str = "", refuse_as: str = "preflight") -> FitReport[S, E]:
    """Estimate ``work`` and, when it does not fit, find the preferred change that does (each re-estimated).

    Single settings are tried in the order ``knobs`` gives (each knob's group in turn, smallest change first);
    when none fits, the knobs together: each at its first setting that fits with the ones before, else its
    strongest, until the estimate fits.

    Args:
        work: the workload.
        estimate: workload -> its estimate.
        available: workload -> GB it may use (the trainer: per rank, which depends on the ranks).
        knobs: workload -> each knob's settings (recomputed on the knobs set before, for the combination).
        source: where the memory figure came from.
        scope: what the figures cover (``FitReport.scope``).
        dead_end: what to do when nothing fits.
        refuse_as: the field a refusal names when nothing fits.
    """
    report = FitReport(estimate(work), work, available(work), source, None, scope, dead_end, refuse_as)
    if report.fits:
        return report

    def fits(w: S) -> bool:
        return estimate(w).total <= available(w)

    pick = next((c for group in knobs(work) for c in group if fits(c.work)), None) or _combined(work, knobs, fits)
    if pick is None:
        return report
    return dataclasses.replace(report, fix=Fix(pick.knob, pick.flags, estimate(pick.work), available(pick.work),
                                               pick.work))


def _combined(work: S, knobs: Knobs, fits: Callable[[S], bool]) -> Candidate[S] | None:
    """Knobs together, in order: each at its first setting that fits with the ones before, else its strongest."""
    changed: list[Candidate[S]] = []
    for k in range(len(knobs(work))):
        group = knobs(work)[k]
        if not group:
            continue
        pick = next((c for c in group if fits(c.work)), group[-1])
        work = pick.work
        changed.append(pick)
        if fits(work):
            return Candidate(changed[0].knob, ", ".join(c.flags for c in changed), work)
    return None


def refuse(report: FitReport[Any, Any], enabled: bool) -> None:
    """Raise when the estimate does not fit and the preflight is on.

    Args:
        report: ``check_fit``'s.
        enabled: the ``preflight`` setting.

    Raises:
        MemoryPreflightError: naming ``report.knob``.
    """
    if enabled and not report.fits:
        raise MemoryPreflightError(report.knob or report.refuse_as, report.message())
