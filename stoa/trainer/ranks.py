"""What every rank of the trainer does with its shard of the model, and how rank 0 makes them do it together.

Rank 0 runs the trainer loop (bucket, pool, lease, journal, publishing). Each time it needs the model it calls
``Driver(kind, *args)``: the command goes to every rank (``Dist.broadcast``) and every rank runs the same
``RankOps`` method, so their collectives (FSDP2's all-gathers and reduce-scatters, the checkpoint's) line up.
The other ranks sit in ``serve`` until rank 0 says ``stop``. At world size 1 the broadcast is a no-op and
``Driver`` simply calls the method: one code path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from stoa.algorithms import Algorithm, get_algorithm
from stoa.bucket import Bucket
from stoa.config import TrainerConfig
from stoa.models.lora_torch import is_adapter
from stoa.trainer import checkpoint as ckpt
from stoa.trainer.ckpt_async import CheckpointWriter
from stoa.trainer.coldstart import SftRow, SftStep, sft_steps
from stoa.trainer.dist import Dist, full_arrays, load_full, timeout_s
from stoa.trainer.lora import FULL, Identity, PublishedBase, base_fingerprint, lora_spec
from stoa.trainer.policy import BaseView, Policy, compute_dtype
from stoa.trainer.pool import Entry
from stoa.trainer.step import StepMetrics, train_step
from stoa.weights.planes import State


def adamw_fused(device: torch.device, sharded: bool) -> bool | None:
    """AdamW's ``fused`` argument: True on one CUDA device, None (torch's default kernel) elsewhere.

    On an H100 the fused kernel took the llama-1b step from 0.647 to 0.625 s (micro-batch 64) and from 0.845 to
    0.738 s (micro-batch 64, gradient checkpointing) (docs/gpu.md); FSDP2's sharded parameters and the CPU keep
    the default, which the CPU tests pin bit for bit.
    """
    return True if device.type == "cuda" and not sharded else None


def base_arrays(policy: Policy, dist: Dist) -> dict[str, np.ndarray]:
    """A LoRA policy's frozen base (every tensor the planes carry but the adapters) as float32 on rank 0, with a
    quantized base's linears as the plane's stored bits (``Policy.base_plane_bits``): what the trainer publishes.

    Args:
        policy: the LoRA ``Policy``.
        dist: the process group (``SINGLE`` for one process).
    """
    base = full_arrays({k: t for k, t in policy.named_tensors().items() if not is_adapter(k)}, dist)
    return {**base, **policy.base_plane_bits()}


def hold_base(policy: Policy, values: dict[str, np.ndarray] | None, state: State | None, dist: Dist) -> None:
    """Set a LoRA policy's frozen base to the published base: its decoded values, and a quantized base's linears
    its stored bits, so it scores on what workers sample with. Every rank calls it, rank 0 with the base.

    Args:
        policy: the LoRA ``Policy``.
        values: the published base decoded as engines compute with it (``PublishedBase.values``) on rank 0,
            ``None`` on the others.
        state: its stored bits (``PublishedBase.state``) on rank 0, ``None`` on the others.
        dist: the process group (``SINGLE`` for one process).
    """
    named = {k: t for k, t in policy.named_tensors().items() if not is_adapter(k)}
    quant = policy.base_plane_bits().keys()
    load_full(named, None if values is None else {k: v for k, v in values.items() if k not in quant}, dist)
    if state is not None:
        policy.load_base_plane_bits(state)


class Command(NamedTuple):
    """One instruction from rank 0 to every rank."""

    kind: str
    """A ``RankOps`` method name, or ``stop``."""
    args: tuple
    """Its arguments (picklable; the same on every rank)."""


class RankOps:
    """One rank's model side: policy (sharded when there are several ranks), reference, optimizer, algorithm.

    Args:
        cfg: the resolved trainer config (rank 0's).
        dist: the ranks.
        device: this rank's device.
        model_dir: the base model (on every rank's machine).
        bucket: the run's bucket (rank 0's is lease-fenced); the checkpoint's shards are written by every rank.
        echo: where notes go.
    """

    def __init__(self, cfg: TrainerConfig, dist: Dist, device: torch.device, model_dir: Path, bucket: Bucket,
                 echo=print):

        self.cfg, self.dist, self.bucket, self.echo = cfg, dist, bucket, echo
        dtype, spec = compute_dtype(cfg.dtype, device), lora_spec(cfg)
        self.policy = Policy(model_dir, device, temperature=cfg.temperature,
                             gradient_checkpointing=cfg.gradient_checkpointing, dist=dist, compute_dtype=dtype,
                             lora=spec, seed=cfg.seed, compute_weights=cfg.compute_weights,
                             base_plane=cfg.lora_base_plane)
        self.identity = (FULL if spec is None else
                         Identity(base_fingerprint(model_dir), spec, cfg.model, self.policy.base_plane))
        self.restored: ckpt.Restored | None = None
        self.algo: Algorithm = get_algorithm(cfg.algo_config(), "torch")
        self.ref: Policy | BaseView | None = None  # a LoRA run's reference is its own base, adapters bypassed
        if self.algo.cfg.kl_beta > 0:
            self.ref = (BaseView(self.policy) if spec is not None else
                        Policy(model_dir, device, temperature=cfg.temperature, trainable=False, dist=dist,
                               compute_dtype=dtype))
        self.opt = torch.optim.AdamW(self.policy.trainable_parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                     fused=adamw_fused(device, dist.sharded))
        self.writer = CheckpointWriter(background=cfg.checkpoint_async and not dist.sharded)

    def step(self, entries: Sequence[Entry], current_version: int, step: int, probe: bool = False) -> StepMetrics:
        """One optimizer step on the step's groups (every rank gets all of them and runs its share); ``probe``: also
        the policy's rounding probe (``stoa.trainer.rounding``)."""
        cfg = self.cfg
        return train_step(self.policy, self.ref, self.opt, self.algo, entries, current_version=current_version,
                          micro_batch=cfg.micro_batch, grad_clip=cfg.grad_clip, shared_prefix=cfg.shared_prefix,
                          step=step, total_steps=cfg.steps, dist=self.dist, top_p=cfg.top_p, probe=probe)

    def cold_start(self, rows: Sequence[SftRow]) -> list[SftStep]:
        """The cold start's supervised steps (every rank runs every row; a sharded model averages equal grads)."""
        cfg, every = self.cfg, max(1, self.cfg.cold_start_steps // 8)

        def note(f: SftStep) -> None:
            if self.dist.main and (f.step % every == 0 or f.step == cfg.cold_start_steps):
                self.echo(f"[trainer] cold start step {f.step}/{cfg.cold_start_steps}: loss {f.loss:.3f} "
                          f"({f.tokens} tokens, {f.seconds:.1f}s)")
        return sft_steps(self.policy, rows, steps=cfg.cold_start_steps, batch=cfg.cold_start_batch,
                         micro_batch=cfg.micro_batch, lr=cfg.cold_start_lr or cfg.lr, grad_clip=cfg.grad_clip,
                         seed=cfg.seed, note=note)

    def keepalive(self) -> None:
        """Nothing: rank 0's sign of life while it waits for records (``Driver.keepalive``)."""

    def export(self) -> dict[str, np.ndarray]:
        """The full fp32 master weights (a LoRA policy's merged) on rank 0 (``{}`` elsewhere)."""
        return self.policy.export_f32()

    def export_adapter(self) -> dict[str, np.ndarray]:
        """A LoRA policy's adapter tensors as float32 on rank 0 (``{}`` elsewhere): what the adapter plane holds."""
        return self.policy.adapter_f32()

    def export_base(self) -> dict[str, np.ndarray]:
        """A LoRA policy's frozen base (every tensor the planes carry but the adapters) as float32 on rank 0; a
        quantized base's linears as the plane's stored bits (``Policy.base_plane_bits``)."""
        return base_arrays(self.policy, self.dist)

    def load_base(self, base: PublishedBase | None = None) -> None:
        """Set a LoRA policy's frozen base (and the reference, which is the base) to rank 0's published base: its
        decoded values (``stoa.trainer.lora.PublishedBase``), and a quantized base's linears its stored bits, so the
        trainer scores on what workers sample with. Every rank calls it, rank 0 with the base."""
        values, state = (None, None) if base is None else (base.values, base.state)
        for policy in (self.policy, self.ref):
            if isinstance(policy, Policy):  # a BaseView is the policy's own base
                hold_base(policy, values, state, self.dist)

    def save(self, version: int, step: int, before_pointer: Callable[[], Any] | None = None) -> int:
        """Checkpoint this step (rank 0 writes its pointer last): wait for the write in flight, take the state
        (a snapshot when the write runs in the background, ``stoa.trainer.ckpt_async``) and write it; its bytes
        when written at once, else 0.

        Args:
            version: the published version these weights are.
            step: optimizer steps taken so far.
            before_pointer: rank 0 calls it before writing the pointer (a wait on ``version``'s upload).
        """
        self.writer.wait()  # at most one write in flight, and one snapshot held
        staged = ckpt.stage_checkpoint(self.policy.model, self.opt, version=version, step=step, dist=self.dist,
                                       keep=self.cfg.keep_checkpoints, identity=self.identity,
                                       snapshot=self.writer.background)
        return self.writer.run(lambda: ckpt.write_staged(self.bucket, self.cfg.run, staged, self.echo, before_pointer),
                               f"stoa-checkpoint-s{step}")

    def settle_save(self) -> None:
        """Wait for the checkpoint write in flight (raises what it raised); every rank."""
        self.writer.wait()

    def load(self) -> ckpt.Restored | None:
        """Load the run's checkpoint at this world size; None when it has none."""
        self.restored = ckpt.load_checkpoint(self.bucket, self.cfg.run, self.policy.model, self.opt, self.dist,
                                             self.echo, identity=self.identity)
        return self.restored

    def load_full(self, arrays: dict[str, np.ndarray] | None = None) -> None:
        """Overwrite the weights from rank 0's full arrays (the published ones when resuming).

        A LoRA policy resumes its fp32 adapter from its checkpoint only (the published adapter is rounded to bf16):
        it keeps its checkpoint's adapter (one line), and without a checkpoint the trainer stops naming the fix.
        """
        if self.policy.lora is None:
            self.policy.load_f32(arrays)
        elif self.restored is not None:
            if self.dist.main:
                self.echo(f"[trainer] LoRA: continuing from the checkpoint's adapter (v{self.restored.version}); "
                          "the published adapter is rounded to bf16, not the trained fp32 one")
        else:
            raise SystemExit(f"stoa: run {self.cfg.run!r} is a LoRA run with published weights but no trainer "
                             "checkpoint, and its fp32 adapter cannot be recovered from the published bf16 one; "
                             "start a new --run (and set checkpoint_every = 1: an adapter checkpoint is small)")


class Driver:
    """Rank 0's handle on every rank's ``RankOps``.

    Args:
        ops: rank 0's own ``RankOps``.
    """

    def __init__(self, ops: RankOps):
        self.ops = ops
        self.last_command = time.monotonic()
        """When the other ranks last heard from rank 0 (``keepalive`` reads it)."""

    def __call__(self, kind: str, *args: Any, main_only: Any = None) -> Any:
        """Run ``ops.<kind>(*args)`` on every rank and return rank 0's result.

        Args:
            kind: the method.
            *args: its arguments, sent to every rank.
            main_only: a last argument only rank 0 passes (other ranks use the method's default), e.g. the full
                arrays of ``load_full``, which would be wasteful to pickle to every rank.
        """
        self.ops.dist.broadcast(Command(kind, args))
        self.last_command = time.monotonic()
        fn = getattr(self.ops, kind)
        return fn(*args) if main_only is None else fn(*args, main_only)

    def keepalive(self) -> bool:
        """While rank 0 waits for records, the other ranks wait in a broadcast; send them a no-op before a quarter
        of the collective timeout has passed (``stoa.trainer.dist.timeout_s``), so an idle fleet never fails the
        job, and a dead rank is found while waiting rather than at the next step. Returns whether one was sent."""
        if not self.ops.dist.sharded or time.monotonic() - self.last_command < timeout_s() / 4:
            return False
        self("keepalive")
        return True

    def stop(self) -> None:
        """Let the other ranks return from ``serve``; each answers first, so a dead rank raises here (a gloo or
        NCCL error) rather than letting rank 0 call a broken job finished."""
        self.ops.dist.broadcast(Command("stop", ()))
        self.ops.dist.gather(True)


def serve(ops: RankOps) -> int:
    """A rank other than 0: run rank 0's commands until it says stop; return how many steps it took.

    Args:
        ops: this rank's ``RankOps``.
    """
    steps = 0
    while True:
        cmd = ops.dist.broadcast()
        if not isinstance(cmd, Command) or cmd.kind == "stop":
            ops.dist.gather(True)
            return steps
        getattr(ops, cmd.kind)(*cmd.args)
        steps += cmd.kind == "step"
