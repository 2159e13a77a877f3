"""Trainer state in the bucket: a sharded checkpoint (master weights + AdamW) and a light per-step journal.

The journal (version, step, reuse counts) is written every step *before* the new version is
published, so a crash can only over-count a use, never let a record exceed the reuse cap.
The heavy checkpoint is written when ``stoa.trainer.cadence`` says (every ``checkpoint_every`` steps and/or
``checkpoint_minutes``, and at the run's end) with ``torch.distributed.checkpoint``: every rank writes its shard
under a fresh ``trainer/checkpoints/<tag>/`` prefix, rank 0 adds the metadata and then the pointer
``trainer/checkpoint.json`` (last), so a half-written checkpoint is never named and never loaded. The pointer
also names the older checkpoints kept (``keep_checkpoints`` in all); every other checkpoint directory, a
half-written one included, is deleted only after the new pointer is written, so the pointer never names a
deleted checkpoint and a kill mid-write leaves the previous one in place. A save is two halves:
:func:`stage_checkpoint` fixes the tag and the state (a host copy when the write runs in the background) and
:func:`write_staged` writes it, on the step's thread or on ``stoa.trainer.ckpt_async``'s writer.
Every file comes from a bucket others can write: the pointer is parsed by ``stoa.untrusted``, and DCP's pickles
are read through ``stoa.trainer.dcp_safe`` (no code runs from them). Any world size loads any checkpoint (DCP
reshards). The single-file checkpoint of older trainers still loads at
world size 1. On restart the trainer resumes from it and continues the version sequence after the newest
published pointer.
A LoRA policy's checkpoint holds the adapter and its AdamW state, its pointer names base and adapter, and rank 0
writes the adapter's PEFT files beside the shards (``stoa.trainer.lora``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from stoa.bucket import Bucket, BucketError, ObjectNotFound
from stoa.layout import checkpoint_files_prefix, checkpoint_key, checkpoint_pointer_key, journal_key
from stoa.models.lora_torch import is_adapter
from stoa.schemas import BadSchemaObject
from stoa.schemas.journal import Journal
from stoa.trainer.ckpt_pointer import (  # noqa: F401 - re-exported: the pointer is part of this module's API
    DELETE_POINTER,
    FORMAT,
    CheckpointError,
    CheckpointRef,
    read_pointer,
)
from stoa.trainer.dcp_safe import SafeEmptyPlanner, SafeLoadPlanner, metadata_problem
from stoa.trainer.dist import SINGLE, Dist, full_arrays
from stoa.trainer.lora import FULL, Identity, identity_problem, put_peft
from stoa.trainer.retry import ride_out
from stoa.untrusted import check_number, load_object

log = logging.getLogger(__name__)

MAX_META_BYTES = 64 << 20
"""Longest ``opt_steps`` metadata of a single-file checkpoint read."""


@dataclass
class Restored:
    """What a restart recovers."""

    version: int
    step: int



@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's note that a world of one saves and loads in a single process (that is the intent)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What a checkpoint holds: the trainable parameters (every one, or a LoRA policy's adapter) by
    ``named_parameters`` name and the optimizer's state."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return {"model": {k: p.detach() for k, p in model.named_parameters() if p.requires_grad},
            "optim": get_optimizer_state_dict(model, opt)}


@dataclass(frozen=True)
class Staged:
    """A checkpoint taken on the step's path, not yet written: what :func:`write_staged` writes, on any thread."""

    tag: str
    version: int
    step: int
    state: dict[str, Any]
    """The DCP state (``model``, ``optim``): the live tensors, or a snapshot of them (:func:`stage_checkpoint`)."""
    adapter: dict[str, Any]
    """A LoRA policy's full adapter arrays on rank 0 (empty otherwise)."""
    identity: Identity
    keep: int
    dist: Dist


def _copy_tree(obj: Any) -> Any:
    """``obj`` with every tensor copied to host memory and every container rebuilt (the live state may move on)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _copy_tree(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_copy_tree(v) for v in obj)
    return obj


def stage_checkpoint(model: torch.nn.Module, opt: torch.optim.Optimizer, *, version: int, step: int,
                     dist: Dist = SINGLE, keep: int = 1, identity: Identity = FULL, snapshot: bool = False) -> Staged:
    """Fix what a checkpoint holds (every rank calls it): its tag, the state and a LoRA policy's adapter.

    Args:
        model: the policy model (fp32 master weights, sharded or not).
        opt: its AdamW optimizer.
        version: the published version these weights are.
        step: optimizer steps taken so far.
        dist: the ranks.
        keep: checkpoints kept in all, this one included.
        identity: a LoRA policy's base and adapter.
        snapshot: copy the state to host memory (12 bytes per trainable parameter), so the next step may change
            the weights while a background thread writes them; False keeps the live tensors (write at once).
    """
    tag = dist.broadcast(f"s{step:010d}-{secrets.token_hex(4)}" if dist.main else None)
    state = _state(model, opt)
    adapter = (full_arrays({k: p for k, p in model.named_parameters() if is_adapter(k)}, dist)
               if identity.spec is not None else {})
    if snapshot:
        state, adapter = _copy_tree(state), {k: v.copy() for k, v in adapter.items()}
    return Staged(tag, version, step, state, adapter, identity, keep, dist)


def write_staged(bucket: Bucket, run_id: str, staged: Staged, echo=print,
                 before_pointer: Callable[[], Any] | None = None) -> int:
    """Write a staged checkpoint: this rank's shard (rank 0 also the metadata, then the pointer, then drop
    checkpoints not kept). Every rank calls it; returns the checkpoint's bytes on rank 0 (this rank's elsewhere).

    Args:
        bucket: the run's bucket (rank 0's is lease-fenced).
        run_id: the run.
        staged: from :func:`stage_checkpoint`.
        echo: where outage notes go.
        before_pointer: rank 0 calls it once every file is in and before the pointer is written (the trainer
            waits there for the weights pointer of the version the checkpoint claims); what it raises stops
            the write, the pointer unwritten.
    """
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    dist = staged.dist
    prefix = checkpoint_files_prefix(run_id, staged.tag)
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="stoa-ckpt-") as tmp:
        with _single_process_quiet():
            dcp_save(staged.state, checkpoint_id=tmp, no_dist=not dist.sharded)
        for name in sorted(os.listdir(tmp)):
            path = os.path.join(tmp, name)
            ride_out(lambda p=path, n=name: bucket.put_file(prefix + n, p, create_only=False),
                     f"checkpoint file {name}", echo)
            sizes[name] = os.path.getsize(path)
    everyone = dist.gather(sizes)  # also the barrier: every shard is in the bucket before the pointer
    if not dist.main:
        return sum(sizes.values())
    files = {k: v for part in everyone for k, v in part.items()}
    identity = staged.identity
    extra = sum(put_peft(bucket, prefix, staged.adapter, identity, echo).values()) if staged.adapter else 0
    if before_pointer is not None:
        before_pointer()
    ref = CheckpointRef(staged.tag, staged.version, staged.step, dist.world_size, files,
                        _kept(bucket, run_id, staged.keep - 1, echo),
                        identity.base if identity.spec is not None else "", identity.adapter)
    ride_out(lambda: bucket.put(checkpoint_pointer_key(run_id), ref.to_json()), "the checkpoint pointer", echo)
    _drop_unkept(bucket, run_id, {staged.tag, *ref.kept}, echo)
    return sum(files.values()) + extra


def save_checkpoint(bucket: Bucket, run_id: str, model: torch.nn.Module, opt: torch.optim.Optimizer,
                    *, version: int, step: int, dist: Dist = SINGLE, echo=print, keep: int = 1,
                    identity: Identity = FULL, before_pointer: Callable[[], Any] | None = None) -> int:
    """Stage and write a checkpoint now (:func:`stage_checkpoint`, then :func:`write_staged`); every rank calls it.

    Returns the checkpoint's bytes on rank 0 (this rank's elsewhere).

    Args:
        bucket: the run's bucket (rank 0's is lease-fenced).
        run_id: the run.
        model: the policy model (fp32 master weights, sharded or not).
        opt: its AdamW optimizer.
        version: the published version these weights are.
        step: optimizer steps taken so far.
        dist: the ranks.
        echo: where outage notes go.
        keep: checkpoints kept in all, this one included (the newest ones the pointers named).
        identity: a LoRA policy's base and adapter (the pointer names them; the PEFT files are written).
        before_pointer: see :func:`write_staged`.
    """
    staged = stage_checkpoint(model, opt, version=version, step=step, dist=dist, keep=keep, identity=identity)
    return write_staged(bucket, run_id, staged, echo, before_pointer)


def _kept(bucket: Bucket, run_id: str, older: int, echo) -> tuple[str, ...]:
    """The tags the next pointer keeps besides its own: the current pointer's and those it kept, newest first."""
    if older <= 0:
        return ()
    try:
        current = ride_out(lambda: read_pointer(bucket, run_id), "(reading) the checkpoint pointer", echo)
    except CheckpointError:  # an unreadable pointer names nothing worth keeping
        return ()
    return () if current is None else (current.tag, *current.kept)[:older]


def _drop_unkept(bucket: Bucket, run_id: str, keep: set[str], echo) -> None:
    """Delete every checkpoint file whose tag ``keep`` lacks (older ones, and half-written ones)."""
    head = checkpoint_files_prefix(run_id)
    try:
        for info in list(bucket.list(head)):
            if info.key[len(head):].split("/", 1)[0] not in keep:
                bucket.delete(info.key)
    except BucketError as e:  # older files only cost storage; the next checkpoint collects them
        echo(f"[trainer] could not delete older checkpoint files ({e}); the next checkpoint retries")


def _fetch(bucket: Bucket, key: str, path: str, what: str) -> None:
    try:
        bucket.get_file(key, path)
    except ObjectNotFound:
        raise CheckpointError(key, f"({what}) is missing", DELETE_POINTER) from None


def _download(bucket: Bucket, run_id: str, ref: CheckpointRef, dest: str, echo=print) -> None:
    """Fetch every file the pointer names into ``dest`` (outages ridden out), checking each size."""
    prefix = checkpoint_files_prefix(run_id, ref.tag)
    for name, size in ref.files.items():
        path = os.path.join(dest, name)
        ride_out(lambda n=name, p=path: _fetch(bucket, prefix + n, p, f"checkpoint file {n} of {ref.tag}"),
                 f"(reading) checkpoint file {name}", echo)
        if os.path.getsize(path) != size:
            raise CheckpointError(prefix + name, f"(checkpoint file {name} of {ref.tag}) is not the size its pointer "
                                  "says", DELETE_POINTER)
    if (problem := metadata_problem(os.path.join(dest, ".metadata"))) is not None:  # before DCP unpickles it
        raise CheckpointError(prefix + ".metadata", f"is not DCP metadata ({problem})", DELETE_POINTER)


def load_checkpoint(bucket: Bucket, run_id: str, model: torch.nn.Module, opt: torch.optim.Optimizer,
                    dist: Dist = SINGLE, echo=print, identity: Identity = FULL) -> Restored | None:
    """Restore weights and optimizer state in place, at any world size; None when the run has no checkpoint.

    Every rank calls it; rank 0 reads the pointer and every rank fetches the files it names.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        model: the freshly loaded (and sharded) policy model.
        opt: its fresh optimizer.
        dist: the ranks.
        echo: where outage notes go.
        identity: this trainer's base and adapter; a checkpoint of another is refused.

    Raises:
        CheckpointError: the checkpoint cannot be read, or belongs to another base or adapter (the message
            names the fix).
    """
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    plan: Any = None
    if dist.main:
        plan = ride_out(lambda: read_pointer(bucket, run_id) or (
            "legacy" if bucket.exists(checkpoint_key(run_id)) else None), "(reading) the checkpoint pointer", echo)
    plan = dist.broadcast(plan)
    if plan is None:
        return None
    have = (plan.adapter, plan.base) if isinstance(plan, CheckpointRef) else ("", "")
    if (problem := identity_problem(*have, identity)) is not None:
        raise CheckpointError(checkpoint_pointer_key(run_id), problem, "resume with the run's own model and lora_rank, "
                              "lora_alpha, lora_targets, lora_base_plane, or " + DELETE_POINTER)
    if plan == "legacy":
        if dist.sharded:
            raise CheckpointError(checkpoint_key(run_id), "is the single-file checkpoint of an older trainer",
                                  "resume once at world size 1 (it then writes a sharded one), or delete it")
        return _load_legacy(bucket, run_id, model, opt)
    with tempfile.TemporaryDirectory(prefix="stoa-ckpt-") as tmp:
        _download(bucket, run_id, plan, tmp, echo)
        state = _state(model, opt)
        try:
            with _single_process_quiet():
                dcp_load(state, checkpoint_id=tmp, planner=SafeLoadPlanner(), no_dist=not dist.sharded)
        except Exception as e:  # noqa: BLE001 - DCP raises many types for a bad file
            raise CheckpointError(checkpoint_files_prefix(run_id, plan.tag), f"does not load ({type(e).__name__})",
                                  DELETE_POINTER) from e
        set_optimizer_state_dict(model, opt, state["optim"])
    return Restored(version=plan.version, step=plan.step)


def _load_legacy(bucket: Bucket, run_id: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Restored:
    """The single-file checkpoint of older trainers (``param/``, ``exp_avg/``, ``exp_avg_sq/`` tensors)."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory(prefix="stoa-ckpt-") as tmp:
        path = str(Path(tmp) / "checkpoint.safetensors")
        ride_out(lambda: _fetch(bucket, checkpoint_key(run_id), path, "the single-file checkpoint"),
                 "(reading) the checkpoint", print)
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(path)
    opt_steps, version, step = _legacy_meta(meta, checkpoint_key(run_id))
    params = dict(model.named_parameters())
    if set(params) != {k.split("/", 1)[1] for k in tensors if k.startswith("param/")}:
        raise CheckpointError(checkpoint_key(run_id), "does not match the model's parameters", "delete it to "
                              "continue from the published weights (the optimizer state restarts)")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[f"param/{name}"].to(p.device))
            if name in opt_steps:
                opt.state[p] = {"step": torch.tensor(opt_steps[name]),
                                "exp_avg": tensors[f"exp_avg/{name}"].to(p.device),
                                "exp_avg_sq": tensors[f"exp_avg_sq/{name}"].to(p.device)}
    return Restored(version=version, step=step)


def _legacy_meta(meta: dict[str, str], key: str) -> tuple[dict[str, float], int, int]:
    """The single-file checkpoint's metadata: per-parameter optimizer steps, version and step (all untrusted)."""
    try:
        steps = load_object((meta.get("opt_steps") or "{}").encode(), "opt_steps", max_bytes=MAX_META_BYTES,
                            max_depth=1)
        opt_steps = {k: check_number(v, f"opt_steps[{k[:64]!r}]", lo=0) for k, v in steps.items()}
        numbers = {k: meta.get(k, "") for k in ("version", "step")}
        if not all(v.isascii() and v.isdigit() and len(v) <= 18 for v in numbers.values()):
            raise ValueError("version or step is not a number")
    except ValueError as e:
        raise CheckpointError(key, f"has malformed metadata ({str(e)[:200]})", "delete it to continue from the "
                              "published weights (the optimizer state restarts)") from None
    return opt_steps, int(numbers["version"]), int(numbers["step"])


def checkpoint_params(bucket: Bucket, run_id: str) -> tuple[int, dict[str, torch.Tensor]] | None:
    """The checkpoint's full fp32 master weights without a model (for export); None when the run has none.

    Args:
        bucket: the run's bucket.
        run_id: the run.
    """
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    ref = read_pointer(bucket, run_id)
    if ref is None:
        return None
    if ref.adapter:
        raise CheckpointError(checkpoint_pointer_key(run_id), f"is a LoRA checkpoint ({ref.adapter}): it holds the "
                              "adapter only", "export --source published for the merged weights; the PEFT adapter "
                              f"is under {checkpoint_files_prefix(run_id, ref.tag)}adapter/")
    state: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="stoa-ckpt-") as tmp:
        _download(bucket, run_id, ref, tmp)
        _load_state_dict(state, storage_reader=FileSystemReader(tmp), planner=SafeEmptyPlanner(), no_dist=True)
    return ref.version, {k: v.float() for k, v in state["model"].items()}


def write_journal(bucket: Bucket, run_id: str, state: dict[str, Any]) -> None:
    """Overwrite the per-step journal (:class:`~stoa.schemas.journal.Journal`).

    Args:
        bucket: the run's bucket.
        run_id: the run.
        state: the trainer's state (version, step, ``Pool.state()``, ``Quarantine.state()``).
    """
    bucket.put(journal_key(run_id), Journal.from_state(state).to_json())


def read_journal(bucket: Bucket, run_id: str) -> dict[str, Any] | None:
    """The journal's trainer state (``Journal.state``), or ``None`` if the run has none yet or it is malformed
    (one warning line).

    A malformed journal (:meth:`Journal.parse <stoa.schemas.journal.Journal.parse>`: over 64 MiB, nested, not an
    object, ``step`` or ``version`` not an integer, ``pool`` or ``quarantine`` not an object) is ignored rather
    than fatal: everything in it can be rebuilt (the step comes from the checkpoint, reuse counts and the
    quarantine start over, at worst letting a record in the window be used ``reuse_cap`` more times), the next
    step overwrites it, and whoever could plant a malformed one could as well plant a well-formed one, so
    stopping would protect nothing. A malformed row inside it is dropped.

    Args:
        bucket: the run's bucket.
        run_id: the run.
    """
    try:
        data = bucket.get(journal_key(run_id))
    except ObjectNotFound:
        return None
    try:
        journal = Journal.parse(data, journal_key(run_id))
    except BadSchemaObject as e:
        log.warning("[trainer] ignoring %s, which %s; the step comes from the checkpoint, reuse counts and the "
                    "quarantine start over", journal_key(run_id), e.problem)
        return None
    return journal.state()
