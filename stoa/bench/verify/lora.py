"""A LoRA run for ``stoa bench verify`` (``--lora-rank``): workers on the base the contract names plus the adapter,
the trainer's LoRA ``Policy`` recomputing on that base.

The trainer side is a LoRA ``Policy`` (``--lora-rank``, ``--lora-alpha``, the default targets) whose base is held as
``--lora-base-plane`` (``int8g64``/``int4g64``: ``QuantLinear`` codes; empty: float) and whose ``lora_B`` are drawn
off zero (N(0, ``--lora-b-std``), fixed seed) so the adapter moves the logprobs. The base is published as a LoRA
trainer publishes it (``stoa.trainer.lora.base_state`` of ``stoa.trainer.ranks.base_arrays``) and the policy then
holds the published base's values, as ``stoa.trainer.ranks.hold_base`` sets them. Honest workers load that base's stored
bits, add adapters through the engine's ``use_adapter`` (what ``stoa.engines.adapter.prepare_adapter`` calls) and
load the adapter plane's version (bf16 bits of the trainer's fp32 adapter). The lies that matter for LoRA
(``lora_lies``): a worker holding a lower-precision base than the contract's, and one sampling without the adapter.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stoa.bench.verify.lagged import MIN_LAG_RECORDS, LagScores
from stoa.bench.verify.liars import How, quantized
from stoa.bench.verify.sampling import Rig
from stoa.bench.verify.steps import values
from stoa.models import resolve_model
from stoa.models.lora_torch import DEFAULT_TARGETS, LoraSpec
from stoa.tasks import get_task
from stoa.tokenize import TextCodec
from stoa.trainer.lora import base_state
from stoa.trainer.sequential import record_score
from stoa.weights.adapter import adapter_state
from stoa.weights.planes import ADAPTER_PLANE, INT4_PLANE, State, state_from_f32, state_to_f32


def plane_label(plane: str, rank: int) -> str:
    """A LoRA pair's plane in the tables: ``int8g64 base + LoRA r8``."""
    return f"{plane} base + LoRA r{rank}"


def contract_planes(args: argparse.Namespace) -> list[str]:
    """The contract planes run: ``--lora-base-plane`` when the base is quantized, else each of ``--planes``."""
    return [args.lora_base_plane] if args.lora_base_plane else [x.strip() for x in args.planes.split(",") if x.strip()]


class LoraRig(Rig):
    """The trainer's LoRA policy on the published base of ``plane``, and workers holding that base plus the adapter.

    Args:
        args: ``stoa bench verify`` flags (``--lora-rank``, ``--lora-alpha``, ``--lora-base-plane``, ``--lora-b-std``).
        plane: the contract's plane (the base's, when quantized).
    """

    def __init__(self, args: argparse.Namespace, plane: str):  # Rig's own __init__ builds a full-weight policy
        import torch

        from stoa.trainer.dist import SINGLE
        from stoa.trainer.policy import Policy
        from stoa.trainer.ranks import base_arrays, hold_base

        self.args, self.plane = args, plane
        self.model_dir = Path(resolve_model(args.model))
        self.spec = LoraSpec(args.lora_rank, args.lora_alpha, DEFAULT_TARGETS)
        self.policy = Policy(self.model_dir, torch.device("cpu"), temperature=args.temperature, lora=self.spec,
                             base_plane=args.lora_base_plane, seed=args.seed)
        self.base = base_state(base_arrays(self.policy, SINGLE), plane)  # what a LoRA trainer publishes
        self.master = state_to_f32(self.base, plane, compute=True)  # PublishedBase.values: the trainer's base
        hold_base(self.policy, self.master, self.base, SINGLE)
        set_adapter(self.policy, args.lora_b_std, args.seed)
        self.adapter: State = adapter_state(self.policy.adapter_f32())
        self.adapter_on = True
        codec = TextCodec(self.model_dir)
        self.task, self.codec, self.eos = get_task("arithmetic"), codec, list(codec.eos_ids)

    def state(self, plane: str) -> dict[str, np.ndarray]:
        """The published base (the rig's one ``plane``)."""
        if plane != self.plane:
            raise ValueError(f"this rig publishes a {self.plane} base, not {plane}; build a LoraRig per plane")
        return self.base

    def label(self, plane: str) -> str:
        """``plane_label``."""
        return plane_label(plane, self.spec.rank)

    def worker(self, engine: str, dtype: str, state: dict[str, np.ndarray], plane: str) -> Any:
        """A worker engine holding base ``state``, the adapters added (``use_adapter``) and the run's adapter version
        loaded (left at zero when ``adapter_on`` is False: a worker sampling from the base alone)."""
        eng = super().worker(engine, dtype, state, plane)
        eng.use_adapter(self.spec.rank, self.spec.alpha, self.spec.targets)
        if self.adapter_on:
            eng.load_state(self.adapter, ADAPTER_PLANE)
        return eng


def set_adapter(policy: Any, std: float, seed: int) -> None:
    """Draw every ``lora_B`` from N(0, ``std``) (fixed seed; a fresh adapter's are zero and move nothing).

    Args:
        policy: the LoRA ``Policy``.
        std: the entries' standard deviation.
        seed: the run's seed.
    """
    import torch

    rng = np.random.default_rng([seed, 31])
    with torch.no_grad():
        for name, p in sorted(policy.named_parameters().items()):
            if name.endswith(".lora_B.weight"):
                p.copy_(torch.from_numpy(rng.normal(0.0, std, tuple(p.shape)).astype(np.float32)))


@dataclass(frozen=True)
class LoraLie:
    """An attack on a LoRA run: the base the liar holds (``how.plane`` or ``how.bits``) and whether it applies the
    adapter."""

    label: str
    how: How
    adapter: bool = True


def lora_lies(plane: str) -> list[LoraLie]:
    """The LoRA attacks, numbered from 1 (``--attacks``): a base of lower precision than the contract's ``plane`` (the
    published base re-quantized to int4g64; 3-bit codes on an int4g64 contract), and the base without the adapter."""
    lower = (LoraLie("3-bit g64 base on the int4g64 plane", How(bits=3)) if plane == INT4_PLANE
             else LoraLie(f"int4g64 base (contract: {plane})", How(plane=INT4_PLANE)))
    return [lower, LoraLie("the base without the adapter", How(), adapter=False)]


def lie_state(rig: LoraRig, how: How) -> tuple[State, str]:
    """The base a liar holds, and its plane: the published base (``how`` honest), or its values on ``how.plane``,
    or rounded to ``how.bits`` bits on the contract's plane (``liars.quantized``)."""
    if how.plane:
        return state_from_f32(rig.master, how.plane), how.plane
    if how.bits:
        return state_from_f32(quantized(rig.master, how.bits), rig.plane), rig.plane
    return rig.base, rig.plane


def lag0(rig: LoraRig, echo=print) -> LagScores:
    """``--lag-records`` honest records on ``--liar-engine`` at lag 0 (no adapter steps between versions here): the
    fleet whose level calibrates the drift (``--drift auto``)."""
    a = rig.args
    if a.lag_records < MIN_LAG_RECORDS:
        raise SystemExit(f"--lag-records must be 0 or >= {MIN_LAG_RECORDS}, got {a.lag_records}")
    engine, _, dtype = a.liar_engine.partition(":")
    groups, secs = rig.sample(engine, dtype, rig.base, rig.plane, -(-a.lag_records // a.groups), a.temperature)
    scores = np.array([record_score(values(np.concatenate(r)), np.inf)
                       for r in rig.residuals(groups[:a.lag_records], False)])
    echo(f"  lag 0: honest score median {np.median(scores):.4f} ({secs:.0f}s)")
    return LagScores({0: scores}, {})


def lora_attacks(rig: LoraRig, cap: float, echo=print) -> tuple[dict[str, np.ndarray], dict[str, list]]:
    """Each LoRA lie's record scores and residuals (``--liar-engine``, fp32 recompute), by label (``--attacks``
    picks by number).

    Args:
        rig: the contract plane's rig.
        cap: the score's cap.
        echo: where progress goes.
    """
    a, out, resid = rig.args, {}, {}
    engine, _, dtype = a.liar_engine.partition(":")
    wanted = {int(x) for x in a.attacks.split(",") if x.strip()} if a.attacks not in ("", "none") else None
    for i, lie in enumerate([] if a.attacks == "none" else lora_lies(rig.plane), 1):
        if wanted is not None and i not in wanted:
            continue
        state, plane = lie_state(rig, lie.how)
        rig.adapter_on = lie.adapter
        try:
            groups, secs = rig.sample(engine, dtype, state, plane, -(-a.attack_records // a.groups), a.temperature)
        finally:
            rig.adapter_on = True
        resid[lie.label] = list(rig.residuals(groups[:a.attack_records], False))
        out[lie.label] = np.array([record_score(values(np.concatenate(r)), cap) for r in resid[lie.label]])
        echo(f"  attack {lie.label}: score mean {out[lie.label].mean():.4f} ({secs:.0f}s)")
    return out, resid
