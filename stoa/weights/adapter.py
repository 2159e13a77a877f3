"""The adapter plane of a LoRA run: the base once, then versions of the adapter tensors only.

A run with ``lora_rank`` > 0 publishes, through the same anchors, PULSE patches and signed pointer as a full
run, states of plane ``adapter`` (``stoa.weights.planes.ADAPTER_PLANE``): the ``...lora_A.weight`` [r, in] and
``...lora_B.weight`` [out, r] tensors as bf16 bits. The base is published once, before the contract, as an anchor
of the contract's plane under ``runs/<run>/weights/base/`` (``publish_base``). The contract's ``adapter`` field
(:class:`AdapterSpec`) names the base (its fingerprint and the state hash of that anchor) and the adapter's shape;
a worker whose model differs, an adapter tensor of another rank or shape, or a base that is not the one named is
refused with an :class:`~stoa.weights.errors.AdapterError` (the follower keeps its last good version).

numpy only: the torch side (adding adapters to a model) is ``stoa.models.lora_torch``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from stoa.bucket import Bucket, ObjectExists, ObjectNotFound
from stoa.layout import ANCHOR_FILE, ANCHOR_MANIFEST, base_prefix
from stoa.untrusted import as_object, check_number, check_text, field_int, field_text
from stoa.weights.anchor import MAX_MANIFEST_BYTES, decode_anchor, encode_anchor, load_manifest
from stoa.weights.errors import AdapterError
from stoa.weights.planes import ADAPTER_PLANE, State, check_plane, state_from_f32

ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
"""What an adapter tensor's name ends with (PEFT's names, ``stoa.models.lora_torch``)."""
MAX_RANK = 1 << 16
"""Largest rank a contract may name."""
_FIELDS = ("base", "base_hash", "rank", "alpha", "targets")


def base_id(architecture: str, config_hash: str, tokenizer_hash: str) -> str:
    """A base model's identity, ``architecture:config_hash:tokenizer_hash`` (``stoa.trainer.lora.base_fingerprint``).

    Args:
        architecture: the fingerprint's architecture.
        config_hash: its config hash.
        tokenizer_hash: its tokenizer hash.
    """
    return f"{architecture}:{config_hash}:{tokenizer_hash}"


@dataclass(frozen=True)
class AdapterSpec:
    """What a LoRA run's contract says about its adapter plane (``RunContract.adapter``)."""

    base: str
    """The base model's identity (:func:`base_id`)."""
    base_hash: str
    """State hash of the base published under ``weights/base/`` (the contract's plane)."""
    rank: int
    """The adapter's rank r."""
    alpha: float
    """LoRA alpha; the update is ``alpha / r * B @ A``."""
    targets: tuple[str, ...]
    """Module-name suffixes adapted (PEFT's rule)."""

    @property
    def scale(self) -> float:
        """alpha / rank."""
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        """The contract's ``adapter`` object."""
        return {"base": self.base, "base_hash": self.base_hash, "rank": self.rank, "alpha": self.alpha,
                "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, d: Any) -> AdapterSpec:
        """Parse and bound a contract's ``adapter`` object.

        Args:
            d: the parsed JSON.

        Raises:
            ValueError: a missing, unknown or mistyped field.
        """
        d = as_object(d, "adapter")
        if sorted(d) != sorted(_FIELDS):
            raise ValueError(f"adapter must have exactly the keys {list(_FIELDS)}")
        targets = d["targets"]
        if not isinstance(targets, list) or not 1 <= len(targets) <= 64:
            raise ValueError("adapter targets must be a list of 1 to 64 names")
        return cls(base=field_text(d, "base", max_len=512), base_hash=field_text(d, "base_hash", max_len=128),
                   rank=field_int(d, "rank", lo=1, hi=MAX_RANK), alpha=check_number(d["alpha"], "alpha", lo=1e-30),
                   targets=tuple(check_text(t, "adapter target", max_len=128) for t in targets))


def target_matches(path: str, targets: Sequence[str]) -> bool:
    """Whether module path ``path`` ends with one of ``targets`` at a name boundary (PEFT's suffix rule, as
    ``stoa.models.lora_torch.matches``).

    Args:
        path: a module path (``model.layers.0.self_attn.q_proj``).
        targets: module-name suffixes.
    """
    return any(path == t or path.endswith("." + t) for t in targets)


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` is an adapter tensor's (``...lora_A.weight`` or ``...lora_B.weight``).

    Args:
        name: a tensor name.
    """
    return name.endswith(ADAPTER_SUFFIXES)


def adapter_state(arrays: Mapping[str, np.ndarray]) -> State:
    """The adapter plane's state of a LoRA policy: its adapter tensors (others dropped) as bf16 bits.

    Args:
        arrays: float32 tensors by parameter name (``Policy.adapter_f32``).
    """
    return state_from_f32({k: v for k, v in arrays.items() if is_adapter_name(k)}, ADAPTER_PLANE)


def check_adapter(state: Mapping[str, np.ndarray], spec: AdapterSpec, linears: Mapping[str, tuple[int, int]]) -> None:
    """Refuse an adapter state that does not fit the contract's rank and the worker's model.

    Args:
        state: the adapter plane's state (bf16 bits).
        spec: the contract's adapter.
        linears: the worker model's adapted linears, module path -> (out, in).

    Raises:
        AdapterError: ``tensor_mismatch`` (tensors missing or unknown), ``wrong_rank`` (the rank is not the
            contract's), ``wrong_shape`` (a dimension is not the linear's), ``bad_format`` (not bf16 bits).
    """
    want = {f"{p}{s}": (p, s) for p in linears for s in ADAPTER_SUFFIXES}
    if set(state) != set(want):
        diff = sorted(set(state) ^ set(want))[:3]
        raise AdapterError("tensor_mismatch", f"adapter tensors differ from the model's targets (e.g. {diff})")
    for name, (path, suffix) in want.items():
        arr = state[name]
        if arr.dtype != np.uint16 or arr.ndim != 2:
            raise AdapterError("bad_format", f"{name}: {arr.dtype}{arr.shape} is not a matrix of bf16 bits")
        out_dim, in_dim = linears[path]
        a_side = suffix == ADAPTER_SUFFIXES[0]
        rank, other = (arr.shape[0], arr.shape[1]) if a_side else (arr.shape[1], arr.shape[0])
        if rank != spec.rank:
            raise AdapterError("wrong_rank", f"{name} has rank {rank}, the contract's adapter is rank {spec.rank}")
        if other != (in_dim if a_side else out_dim):
            raise AdapterError("wrong_shape", f"{name} is {arr.shape}, the model's {path} is [{out_dim}, {in_dim}]")


def base_problem(spec: AdapterSpec, mine: str) -> str | None:
    """Why a worker whose model is ``mine`` (:func:`base_id`) cannot use the contract's adapters (None: it can).

    Args:
        spec: the contract's adapter.
        mine: this worker's base identity.
    """
    if spec.base != mine:
        return f"the run's adapters are for base {spec.base[:200]!r}, this worker's model is {mine[:200]!r}"
    return None


def publish_base(bucket: Bucket, run_id: str, state: Mapping[str, np.ndarray], plane: str) -> str:
    """Publish the base once as an anchor (file, then manifest) under ``weights/base/``; its state hash.

    A restarted trainer finds it there: the same base gives the same hash; another raises ``wrong_base``.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        state: the base's stored bits in ``plane`` (``state_from_f32``).
        plane: the contract's plane (``bf16`` or ``int8g64``).
    """
    check_plane(plane)
    data, manifest = encode_anchor(state, run_id=run_id, version=0, plane=plane)
    prefix = base_prefix(run_id)
    try:
        old = load_manifest(bucket.get(prefix + ANCHOR_MANIFEST))
    except ObjectNotFound:
        old = None
    if old is not None:
        if old["state_hash"] != manifest["state_hash"]:
            raise AdapterError("wrong_base", f"run {run_id!r} published another base ({old['state_hash']}); "
                                             "use the run's model or a new --run")
        return str(manifest["state_hash"])
    for key, body in ((prefix + ANCHOR_FILE, data),
                      (prefix + ANCHOR_MANIFEST, json.dumps(manifest, sort_keys=True, indent=1).encode())):
        try:
            bucket.put_create(key, body)
        except ObjectExists:
            bucket.put(key, body)  # a crashed attempt's left-over: nobody references it before the manifest
    return str(manifest["state_hash"])


def fetch_base(bucket: Bucket, run_id: str, plane: str, spec: AdapterSpec) -> State:
    """The run's base, verified: its manifest's state hash must be the contract's and every tensor hash hold.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        plane: the contract's plane.
        spec: the contract's adapter (its ``base_hash``).

    Raises:
        AdapterError: ``wrong_base`` when the published base is not the one the contract names.
        AnchorError: a malformed, oversize or damaged base object.
        ObjectNotFound: no base published yet.
    """
    prefix = base_prefix(run_id)
    listed = {i.key[len(prefix):]: i.size for i in bucket.list(prefix)}
    if listed.get(ANCHOR_MANIFEST, 0) > MAX_MANIFEST_BYTES:
        raise AdapterError("bad_format", f"{prefix}{ANCHOR_MANIFEST} is listed at {listed[ANCHOR_MANIFEST]} bytes")
    manifest = load_manifest(bucket.get(prefix + ANCHOR_MANIFEST))
    if manifest["state_hash"] != spec.base_hash:
        raise AdapterError("wrong_base", f"the published base is {manifest['state_hash']}, the contract names "
                                         f"{spec.base_hash}")
    if ANCHOR_FILE in listed and listed[ANCHOR_FILE] != manifest["size"]:
        raise AdapterError("bad_format", f"base file listed at {listed[ANCHOR_FILE]} bytes, manifest says "
                                         f"{manifest['size']}")
    return decode_anchor(bytearray(bucket.get(prefix + ANCHOR_FILE)), manifest, run_id=run_id, plane=plane,
                         version=0)
