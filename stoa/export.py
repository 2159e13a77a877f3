"""Export a run's model as a Hugging Face directory that transformers and mlx-lm both open.

Two sources:

- ``published`` (default): the exact published weight plane of a version, rebuilt from the newest anchor at or
  before it plus the patches after it and verified like a worker verifies them (``WeightSync``). A ``bf16``
  plane is written as bfloat16 bit for bit. An ``int8g64`` plane is dequantized exactly as MLX dequantizes it
  (every value is a bfloat16 number) and written as bfloat16 too: lossless, and both loaders open a plain
  bfloat16 checkpoint, while mlx-lm's quantized layout would not load in transformers. A LoRA run's ``adapter``
  plane is merged into the base it published (``W + alpha / r * B @ A`` in float32, ``stoa.weights.adapter``) and
  written as bfloat16.
- ``checkpoint``: the trainer's fp32 master weights (its sharded checkpoint under ``trainer/``), written as float32;
  the AdamW moments stay behind.

Planes and checkpoints name tensors as the transformers model does; the export writes the names of the family's
own Hugging Face checkpoints (transformers' reverse of its load-time conversions: a MoE's fused 3-D experts are
split per expert again), which transformers and mlx-lm both read. Tied weights appear once (the config's
``tie_word_embeddings`` ties them again on load). The trainer checkpoint holds parameters only: a persistent
buffer (LFM2-MoE's ``expert_bias``, never trained) is taken from the published plane.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from stoa.bucket import Bucket, ObjectNotFound
from stoa.contract import RunContract, download_model_files
from stoa.layout import ANCHOR_MANIFEST, anchor_prefix, checkpoint_key, contract_key, patch_key, pointer_key
from stoa.models.hf_dir import ExportError, check_out_dir, checkpoint_names, meta_model, missing_buffers, write_hf_dir
from stoa.weights.adapter import fetch_base
from stoa.weights.anchor import load_manifest
from stoa.weights.errors import WeightsError
from stoa.weights.patch_format import read_patch_header
from stoa.weights.planes import ADAPTER_PLANE, State, state_to_f32
from stoa.weights.pointer import Pointer, complete, list_anchors, list_patches, now_iso
from stoa.weights.signing import trusted_run_key
from stoa.weights.sync import WeightSync

SOURCES = ("published", "checkpoint")
Echo = Callable[[str], Any]


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote.

    Args:
        out: the directory written.
        source: ``published`` or ``checkpoint``.
        version: the policy version exported.
        dtype: ``bfloat16`` or ``float32``.
        tensors: number of tensors written.
        nbytes: size of ``model.safetensors``.
    """

    out: Path
    source: str
    version: int
    dtype: str
    tensors: int
    nbytes: int


def bf16_tensors(state: State, plane: str) -> dict[str, Any]:
    """The float weights of a stored-bit state as bfloat16 torch tensors, exactly.

    bf16 bits are reinterpreted, not converted; an int8g64 matrix is dequantized like MLX (its values are
    bfloat16 numbers, so the cast is exact).

    Args:
        state: stored bits of ``plane``.
        plane: ``bf16`` or ``int8g64``.
    """
    import torch

    if plane == "bf16":
        return {k: torch.from_numpy(np.ascontiguousarray(v).view(np.int16)).view(torch.bfloat16)
                for k, v in state.items()}
    return {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in state_to_f32(state, plane).items()}


def merged_tensors(bucket: Bucket, run_id: str, state: State) -> dict[str, Any]:
    """A LoRA run's published adapter merged into its published base, as bfloat16 torch tensors.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        state: a verified state of the ``adapter`` plane.

    Raises:
        ExportError: the contract names no adapter, or the base does not verify against it.
    """
    import torch

    from stoa.models.lora_torch import merge_arrays

    contract = RunContract.from_json(bucket.get(contract_key(run_id)), contract_key(run_id))
    spec = contract.adapter_spec
    if spec is None:
        raise ExportError(f"run {run_id!r} publishes adapter versions but its contract names no adapter")
    try:
        base = state_to_f32(fetch_base(bucket, run_id, contract.plane, spec), contract.plane)
    except WeightsError as e:
        raise ExportError(f"run {run_id!r}: its published base is refused ({e}); restore it from a backup") from None
    adapter = state_to_f32(state, ADAPTER_PLANE)
    paths = sorted({k.removesuffix(".lora_A.weight") for k in adapter if k.endswith(".lora_A.weight")})
    merged = merge_arrays({**base, **adapter}, paths, spec.scale)
    return {k: torch.from_numpy(np.ascontiguousarray(v)).to(torch.bfloat16) for k, v in merged.items()}


def _state_hash_at(bucket: Bucket, run_id: str, version: int, anchors: dict[int, dict[str, int]],
                   patches: dict[int, int]) -> str | None:
    """The state hash of an older version: its anchor's manifest, else its patch's header; None when gone."""
    if version in anchors and complete(anchors[version]):
        return str(load_manifest(bucket.get(anchor_prefix(run_id, version) + ANCHOR_MANIFEST))["state_hash"])
    if version in patches:
        return read_patch_header(bucket.get(patch_key(run_id, version))).state_hash
    return None


def _target(bucket: Bucket, run_id: str, version: int | None, run_key: str = "", echo: Echo = print) -> Pointer:
    """The pointer to rebuild: the current one (its signature checked on a signed run), or one naming an older
    version that the bucket still holds."""
    try:
        current = Pointer.from_json(bucket.get(pointer_key(run_id))).check_signature(run_key)
    except ObjectNotFound:
        raise ExportError(f"run {run_id!r} has published no weights yet; start its trainer, or export "
                          "--source checkpoint") from None
    except WeightsError as e:
        raise ExportError(f"the weights pointer of run {run_id!r} is refused ({e}); it was not written by the "
                          "run's trainer: export --source checkpoint, or wait for the trainer's next version") from None
    if version is None or version == current.version:
        return current
    if run_key:
        echo(f"[export] v{version} is not the signed pointer's version: it is verified by its hash chain only")
    if version < 1 or version > current.version:
        raise ExportError(f"run {run_id!r} has no version {version}; choose --version between 1 and "
                          f"{current.version} (the newest)")
    anchors, patches = list_anchors(bucket, run_id), list_patches(bucket, run_id)
    oldest = min([v for v, o in anchors.items() if complete(o)], default=current.version)
    s_hash = _state_hash_at(bucket, run_id, version, anchors, patches) if version >= oldest else None
    if s_hash is None:
        raise ExportError(f"version {version} of run {run_id!r} is gone (retention keeps v{oldest}.."
                          f"v{current.version}); choose --version in that range, or --source checkpoint")
    return Pointer(run_id, version, max(v for v in anchors if v <= version and complete(anchors[v])),
                   current.plane, s_hash, now_iso())


def published_state(bucket: Bucket, run_id: str, version: int | None,
                    echo: Echo = print) -> tuple[Pointer, State]:
    """Rebuild and verify the published plane of ``version`` (default: the pointer's).

    Args:
        bucket: the run's bucket.
        run_id: the run.
        version: the version to rebuild; None for the current one.
        echo: progress lines.

    Returns:
        (the pointer naming the version, its verified stored-bit state).
    """
    run_key = trusted_run_key(RunContract.from_json(bucket.get(contract_key(run_id))).run_key, bucket.url, run_id,
                              echo=echo, who="export")
    target = _target(bucket, run_id, version, run_key, echo)
    echo(f"[export] rebuilding v{target.version} of run {run_id!r} (plane {target.plane}) from anchor "
         f"v{target.anchor_version} and its patches")
    sync = WeightSync(bucket, run_id, target.plane, run_key=run_key if target.signature else "")
    try:
        _, state = sync.sync(target)
    except WeightsError as e:
        raise ExportError(f"v{target.version} of run {run_id!r} could not be rebuilt and verified ({e}); "
                          "choose another --version, or --source checkpoint") from None
    echo(f"[export] verified v{target.version}: {sync.metrics['versions_applied']} patches applied, "
         f"{sync.metrics['bytes'] / 1e6:.1f} MB read")
    return target, state


def checkpoint_tensors(bucket: Bucket, run_id: str) -> tuple[int, dict[str, Any]]:
    """The trainer's fp32 master weights (optimizer moments dropped): its sharded checkpoint, else the
    single-file one of an older trainer (``param/`` prefix stripped).

    Args:
        bucket: the run's bucket.
        run_id: the run.

    Returns:
        (the version the checkpoint is at, name -> float32 torch tensor).
    """

    from stoa.trainer.checkpoint import checkpoint_params

    sharded = checkpoint_params(bucket, run_id)
    if sharded is not None:
        return sharded
    fd, tmp = tempfile.mkstemp(suffix=".safetensors")
    os.close(fd)
    try:
        try:
            bucket.get_file(checkpoint_key(run_id), tmp)
        except ObjectNotFound:
            raise ExportError(f"run {run_id!r} has no trainer checkpoint yet; export --source published"
                              ) from None
        with safe_open(tmp, "pt") as f:
            meta = f.metadata() or {}
            tensors = {k.split("/", 1)[1]: f.get_tensor(k).float()
                       for k in f.keys() if k.startswith("param/")}
    finally:
        os.unlink(tmp)
    return int(meta.get("version", 0)), tensors


def export_run(bucket: Bucket, run_id: str, out: str | os.PathLike[str], *, version: int | None = None,
               source: str = "published", echo: Echo = print) -> ExportResult:
    """Write a Hugging Face directory of a run's model (see the module docstring for the two sources).

    Args:
        bucket: the run's bucket.
        run_id: the run.
        out: a new (or empty) directory.
        version: the version to export (``published`` only; default: the pointer's).
        source: ``published`` or ``checkpoint``.
        echo: progress lines.

    Raises:
        ExportError: unknown run, source or version, a version gone by retention, OUT not empty.
    """
    out = Path(out)
    if source not in SOURCES:
        raise ExportError(f"unknown --source {source!r}; choose one of {', '.join(SOURCES)}")
    if source == "checkpoint" and version is not None:
        raise ExportError("--version applies to --source published only (the checkpoint holds one version)")
    check_out_dir(out)
    if not bucket.exists(contract_key(run_id)):
        raise ExportError(f"run {run_id!r} not found in this bucket (no {contract_key(run_id)}); check --run "
                          "and --bucket")
    if source == "published":
        pointer, state = published_state(bucket, run_id, version, echo)
        tensors = merged_tensors(bucket, run_id, state) if pointer.plane == ADAPTER_PLANE else bf16_tensors(
            state, pointer.plane)
        dtype, at = "bfloat16", pointer.version
    else:
        echo(f"[export] reading the trainer checkpoint of run {run_id!r}")
        at, tensors = checkpoint_tensors(bucket, run_id)
        dtype = "float32"
    with tempfile.TemporaryDirectory() as files:
        model_dir = download_model_files(bucket, run_id, Path(files))
        model = meta_model(model_dir)
        if missing := missing_buffers(tensors, model):
            echo(f"[export] {len(missing)} buffers are not in the checkpoint; reading them from the plane")
            pointer, state = published_state(bucket, run_id, None, echo)
            plane = bf16_tensors(state, pointer.plane)
            tensors.update({k: plane[k].float() for k in missing if k in plane})
        tensors = checkpoint_names(tensors, model)
        echo(f"[export] writing {len(tensors)} tensors ({dtype}) to {out}")
        nbytes = write_hf_dir(out, tensors, model_dir, dtype)
    return ExportResult(out, source, at, dtype, len(tensors), nbytes)
