"""The trainer's LoRA settings as an adapter spec, the base's identity, and the checkpoint's PEFT files.

A LoRA trainer's checkpoint holds its trainable parameters only (the adapter) and their AdamW state. It belongs
to one base and one adapter (``Identity``): its pointer names both (``base``: the model's fingerprint;
``adapter``: rank, alpha, targets) and a trainer with another refuses it (``identity_problem``). Beside the
shards, rank 0 writes the adapter as PEFT loads it (``put_peft``: ``adapter/adapter_model.safetensors`` and
``adapter/adapter_config.json`` under the checkpoint's prefix). Before the contract, ``publish_adapter_base``
publishes the base once and names it in the contract's adapter plane (``stoa.weights.adapter``); the trainer's
frozen base then takes the published base's decoded values, so it scores on what workers sample with.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stoa.bucket import Bucket
from stoa.contract import ContractMismatch
from stoa.layout import ANCHOR_MANIFEST, base_prefix
from stoa.models import model_fingerprint
from stoa.models.lora_torch import LoraSpec, write_peft
from stoa.trainer.retry import ride_out
from stoa.weights.adapter import AdapterSpec, base_id, fetch_base, publish_base
from stoa.weights.anchor import load_manifest
from stoa.weights.errors import AdapterError, WeightsError
from stoa.weights.planes import State, state_from_f32, state_to_f32


def lora_spec(cfg: Any) -> LoraSpec | None:
    """The adapter the trainer settings ask for (``lora_rank``, ``lora_alpha``, ``lora_targets``); None for full
    fine-tuning (``lora_rank`` 0).

    Args:
        cfg: the ``TrainerConfig``.
    """
    if not getattr(cfg, "lora_rank", 0):
        return None
    targets = tuple(t.strip() for t in cfg.lora_targets.split(",") if t.strip())
    return LoraSpec(int(cfg.lora_rank), float(cfg.lora_alpha), targets)


def base_fingerprint(model_dir: str | Path) -> str:
    """The base's identity: ``architecture:config_hash:tokenizer_hash`` (the weights are not hashed).

    Args:
        model_dir: the base model's directory.
    """
    fp = model_fingerprint(Path(model_dir))
    return base_id(fp.architecture, fp.config_hash, fp.tokenizer_hash)


@dataclass(frozen=True)
class Identity:
    """What a LoRA checkpoint belongs to: the base and the adapter (both empty for full fine-tuning)."""

    base: str = ""
    """The base model's fingerprint (``base_fingerprint``)."""
    spec: LoraSpec | None = None
    """The adapter's rank, alpha and targets."""
    model: str = ""
    """The model setting, named in the PEFT config's ``base_model_name_or_path``."""
    base_plane: str = ""
    """The plane the base is held quantized in (``lora_base_plane``; empty: the compute dtype)."""

    @property
    def adapter(self) -> str:
        """``spec.describe()`` (then ``,base_plane=<plane>`` for a quantized base), or empty for full fine-tuning."""
        if self.spec is None:
            return ""
        return self.spec.describe() + (f"{BASE_PLANE_TAG}{self.base_plane}" if self.base_plane else "")


BASE_PLANE_TAG = ",base_plane="
"""What joins a quantized base's plane to the adapter's description in a checkpoint pointer's ``adapter``."""
FULL = Identity()
"""Full fine-tuning's identity."""


def _base_plane(adapter: str) -> str:
    """The base plane an identity's ``adapter`` string names (empty: the compute dtype)."""
    return adapter.rpartition(BASE_PLANE_TAG)[2] if BASE_PLANE_TAG in adapter else ""


def identity_problem(adapter: str, base: str, mine: Identity) -> str | None:
    """Why a checkpoint of ``adapter`` on ``base`` cannot resume a trainer of identity ``mine`` (None: it can).

    Args:
        adapter: the checkpoint's adapter (empty: full fine-tuning).
        base: the checkpoint's base fingerprint.
        mine: this trainer's identity.
    """
    if adapter and mine.adapter and _base_plane(adapter) != mine.base_plane:
        theirs = _base_plane(adapter)
        return (f"holds an adapter trained on a base held {theirs or 'at the compute dtype'} but this trainer holds "
                f"its base {mine.base_plane or 'at the compute dtype'}; set lora_base_plane = {theirs!r} to resume it")
    if adapter != mine.adapter:
        what = f"a LoRA adapter ({adapter[:200]})" if adapter else "a full fine-tune's weights"
        ours = f"a LoRA adapter ({mine.adapter})" if mine.adapter else "full fine-tuning"
        return f"holds {what} but this trainer runs {ours}"
    if adapter and base != mine.base:
        return f"holds an adapter of base {base[:120]!r}, not of this trainer's model ({mine.base!r})"
    return None


def pointer_text(d: dict[str, Any], name: str) -> str:
    """Optional string field ``name`` of a checkpoint pointer (at most 4,096 characters; absent: empty).

    Args:
        d: the parsed pointer.
        name: ``base`` or ``adapter``.

    Raises:
        ValueError: not such a string.
    """
    value = d.get(name, "")
    if not isinstance(value, str) or len(value) > 4096:
        raise ValueError(f"{name} is not a string of at most 4096 characters")
    return value


def put_peft(bucket: Bucket, prefix: str, adapter: dict[str, Any], ident: Identity, echo) -> dict[str, int]:
    """Write the adapter as PEFT files under ``<prefix>adapter/`` (rank 0); their sizes by file name.

    Args:
        bucket: the run's bucket.
        prefix: the checkpoint's prefix.
        adapter: adapter tensors by parameter name (full, float32).
        ident: the trainer's identity (its spec and model name).
        echo: where outage notes go.
    """
    assert ident.spec is not None
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="stoa-peft-") as tmp:
        write_peft(tmp, adapter, ident.spec, ident.model)
        for name in sorted(os.listdir(tmp)):
            path = os.path.join(tmp, name)
            ride_out(lambda p=path, n=name: bucket.put_file(f"{prefix}adapter/{n}", p, create_only=False),
                     f"adapter file {name}", echo)
            sizes[name] = os.path.getsize(path)
    return sizes


@dataclass(frozen=True)
class PublishedBase:
    """A LoRA run's published base: the contract's adapter plane and the base's values as workers compute with them."""

    spec: AdapterSpec
    """The contract's ``adapter``: the base's identity and hash, the adapter's rank, alpha and targets."""
    state: State
    """The published base's stored bits (a quantized-base trainer's linears load these: ``RankOps.load_base``)."""
    values: dict[str, np.ndarray]
    """The published base decoded to float32 as engines compute with it (bf16 bits widened; int8g64 as MLX's quantized
    matmul and the torch engine dequantize, ``state_to_f32(..., compute=True)``): the trainer's
    frozen base is set to these (``RankOps.load_base``), so it recomputes on the base the contract names."""


def publish_adapter_base(bucket: Bucket, cfg: Any, ident: Identity, base: dict[str, Any], echo) -> PublishedBase:
    """Publish a LoRA run's base once (``stoa.weights.adapter.publish_base``, the contract's plane); the contract's
    adapter plane and the published base's values.

    A restarted trainer whose model was rebuilt from the bucket (``stoa.trainer.setup.model_from_bucket``) holds the
    published base's decoded values, which an int8g64 plane does not quantize back to the same bits: such a base is
    accepted as the run's own (every value equal to the published base's).

    Args:
        bucket: the run's bucket.
        cfg: the ``TrainerConfig`` (its run and plane).
        ident: the trainer's identity (its base fingerprint and spec).
        base: the base's float32 tensors (``RankOps.export_base``; rank 0's).
        echo: where outage notes go.

    Raises:
        ContractMismatch: the run already published another base (``adapter.base_hash``).
    """
    assert ident.spec is not None
    state = base_state(base, cfg.plane)
    try:
        base_hash = ride_out(lambda: publish_base(bucket, cfg.run, state, cfg.plane), "the base weights", echo)
    except AdapterError as e:  # the run published another base (same config and tokenizer, other weights)
        base_hash, state = ride_out(lambda: _rebuilt_base(bucket, cfg, ident, base), "the base weights", echo)
        if not base_hash:
            raise ContractMismatch(["adapter.base_hash"], e.detail) from None
    spec = AdapterSpec(ident.base, base_hash, ident.spec.rank, ident.spec.alpha, ident.spec.targets)
    return PublishedBase(spec, state, state_to_f32(state, cfg.plane, compute=True))


def base_state(base: dict[str, Any], plane: str) -> State:
    """The published base's stored bits: float tensors through ``state_from_f32``, a quantized trainer base's
    linears as they are (``RankOps.export_base`` gives their plane bits: uint32 codes, uint16 scales and biases).

    Args:
        base: ``RankOps.export_base``'s arrays.
        plane: the run's plane.
    """
    stored = {k: v for k, v in base.items() if np.asarray(v).dtype in (np.uint32, np.uint16)}
    return {**state_from_f32({k: v for k, v in base.items() if k not in stored}, plane), **stored}


def _rebuilt_base(bucket: Bucket, cfg: Any, ident: Identity, base: dict[str, Any]) -> tuple[str, State]:
    """The run's published base (hash, bits) when ``base`` holds exactly its decoded values, else ``("", {})``."""
    assert ident.spec is not None
    manifest = load_manifest(bucket.get(base_prefix(cfg.run) + ANCHOR_MANIFEST))
    spec = AdapterSpec(ident.base, str(manifest["state_hash"]), ident.spec.rank, ident.spec.alpha, ident.spec.targets)
    try:
        state = fetch_base(bucket, cfg.run, cfg.plane, spec)
    except WeightsError:
        return "", {}
    values = state_to_f32(state, cfg.plane)
    same = values.keys() == base.keys() and all(np.array_equal(values[k], np.asarray(base[k])) for k in values)
    return (spec.base_hash, state) if same else ("", {})
