"""The trainer's ranks: one process per device under ``torchrun``, FSDP2 sharding, and the collectives the
trainer needs (rank 0's objects to every rank, every rank's objects to rank 0).

World size 1 (a plain ``stoa trainer``) is the same code with every collective a no-op and no sharding. Under
``torchrun --nproc-per-node G``, rank 0 owns the bucket (pool, journal, lease, publishing) and hands each step's
groups to every rank; each rank runs its share of the micro-batches on an FSDP2-sharded model (each decoder block,
then the root, ``fully_shard`` on an explicit 1-D mesh), gradients are summed in fp32 (the loss normaliser is the
whole step's, so the step equals the single-process one), and rank 0 gathers the full weights to publish.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class Dist:
    """This process's place among the trainer's ranks (world size 1: alone, every collective a no-op)."""

    rank: int = 0
    world_size: int = 1
    mesh: Any = None
    """The 1-D ``DeviceMesh`` FSDP2 shards over; None at world size 1."""

    @property
    def main(self) -> bool:
        """Whether this is rank 0 (the bucket's side of the trainer)."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded over more than one rank."""
        return self.world_size > 1

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; only the trainer's own ranks exchange it).

        Args:
            obj: the object (read on rank 0 only).
        """
        if not self.sharded:
            return obj
        import torch.distributed as td

        box = [obj if self.main else None]
        td.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on rank 0, in rank order (``[]`` on other ranks).

        Args:
            obj: this rank's object.
        """
        if not self.sharded:
            return [obj]
        import torch.distributed as td

        out: list[Any] | None = [None] * self.world_size if self.main else None
        td.gather_object(obj, out, dst=0)
        return out or []

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.sharded:
            import torch.distributed as td

            td.barrier()


SINGLE = Dist()
"""World size 1."""

DEFAULT_TIMEOUT_S = 1800.0
"""How long a rank waits in one collective before the job fails (``STOA_DIST_TIMEOUT_S`` overrides it). The
other ranks wait in a broadcast while rank 0 waits for records, so rank 0 sends a keep-alive well inside it
(``stoa.trainer.ranks.Driver.keepalive``): a quiet fleet never times the job out."""


def timeout_s() -> float:
    """The collective timeout in seconds: ``STOA_DIST_TIMEOUT_S`` or :data:`DEFAULT_TIMEOUT_S`."""
    raw = os.environ.get("STOA_DIST_TIMEOUT_S", "").strip()
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"STOA_DIST_TIMEOUT_S={raw!r} is not a number of seconds; unset it or set e.g. 1800") from None
    if not 0 < value < float("inf"):
        raise ValueError(f"STOA_DIST_TIMEOUT_S={raw!r} must be a positive, finite number of seconds; "
                         "unset it or set e.g. 1800")
    return value


def init_dist(device: str) -> tuple[Dist, torch.device]:
    """Join the ``torchrun`` job this process belongs to (its ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``), or stay
    alone: NCCL on CUDA (one device per local rank), gloo on CPU.

    Args:
        device: the configured device (``auto``, ``cpu``, ``cuda``, ``cuda:N``; under torchrun a CUDA device is
            always the local rank's).

    Returns:
        the ranks and this rank's device.
    """
    from stoa.engines.torch import resolve_device

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    dev = resolve_device(device)
    if world <= 1:
        return SINGLE, dev
    import torch.distributed as td
    from torch.distributed.device_mesh import init_device_mesh

    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    if not td.is_initialized():
        td.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s()))
    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp",))
    return Dist(td.get_rank(), world, mesh), dev


def close_dist(dist: Dist) -> None:
    """Leave the process group (a no-op at world size 1).

    Args:
        dist: the ranks.
    """
    if dist.sharded:
        import torch.distributed as td

        if td.is_initialized():
            td.destroy_process_group()


def shard(root: torch.nn.Module, blocks: Sequence[torch.nn.Module], dist: Dist, param_dtype: torch.dtype) -> None:
    """FSDP2 on every block, then the root; gradients are summed (not averaged) and reduced in fp32.

    The sum is what makes a sharded step equal the single-process one: each rank's loss is already divided by the
    whole step's normaliser. Master weights stay fp32 (the sharded parameters); ``param_dtype`` is what a block's
    all-gathered parameters compute in.

    Args:
        root: the module whose forward every score runs through.
        blocks: the decoder blocks (each its own all-gather unit).
        dist: the ranks (``dist.sharded``).
        param_dtype: compute dtype of the gathered parameters (bf16 on CUDA; fp32 for exact CPU checks).
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mesh=dist.mesh, mp_policy=mp)
    fully_shard(root, mesh=dist.mesh, mp_policy=mp)
    for m in root.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # a sum: the loss carries the global normaliser
            m.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum


def full_arrays(named: dict[str, torch.Tensor], dist: Dist) -> dict[str, np.ndarray]:
    """The full parameters as float32 arrays on rank 0 (``{}`` on other ranks); every rank must call it.

    Sharded parameters are all-gathered one at a time, so no rank ever holds more than one full tensor beyond
    rank 0's copy. At world size 1 the arrays share memory with the parameters on CPU.

    Args:
        named: the parameters by name.
        dist: the ranks.
    """
    out: dict[str, np.ndarray] = {}
    for name, p in named.items():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # type: ignore[operator]
        if dist.main:
            out[name] = full.detach().float().cpu().numpy()
    return out


def load_full(named: dict[str, torch.Tensor], arrays: dict[str, np.ndarray] | None, dist: Dist) -> None:
    """Overwrite every parameter (and buffer) from rank 0's full float32 arrays (other ranks pass None); every rank
    calls it.

    Args:
        named: the parameters by name.
        arrays: name -> full array, on rank 0.
        dist: the ranks.

    Raises:
        ValueError: the arrays' names are not the parameters' (checked on rank 0, raised on every rank).
    """
    if not dist.broadcast(arrays is not None and set(arrays) == set(named)):
        raise ValueError("checkpoint tensors do not match the model's parameters")
    with torch.no_grad():
        for name, p in named.items():
            if not dist.sharded:
                assert arrays is not None
                p.copy_(torch.from_numpy(arrays[name]).to(p.device))
                continue
            from torch.distributed.tensor import DTensor, distribute_tensor

            if not isinstance(p, DTensor):  # a buffer FSDP2 leaves whole on every rank (a small one)
                p.copy_(torch.from_numpy(dist.broadcast(arrays[name] if arrays is not None else None)).to(p.device))
                continue
            full = (torch.from_numpy(arrays[name]) if arrays is not None
                    else torch.empty(p.shape, dtype=torch.float32)).to(p.device, p.dtype)
            p.to_local().copy_(distribute_tensor(full, dist.mesh, p.placements, src_data_rank=0).to_local())


def split_groups(group_tokens: Sequence[int], world_size: int) -> list[list[int]]:
    """Groups assigned to ranks by tokens, largest first to the least-loaded rank (ties: the lower rank).

    Args:
        group_tokens: tokens each group's rows forward (prompt + completion, summed over its rows).
        world_size: ranks.

    Returns:
        per rank, its group indices in ascending order.
    """
    load = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for g in sorted(range(len(group_tokens)), key=lambda g: (-group_tokens[g], g)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        out[r].append(g)
        load[r] += int(group_tokens[g])
    return [sorted(gs) for gs in out]
