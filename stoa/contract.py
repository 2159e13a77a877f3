"""The run's set-up objects, written once by the trainer before anything else and read by every worker.

- ``RunContract`` (``run.json``): what both sides must agree on (model fingerprints, group size, plane,
  task, sampling); create-only, written first; a worker (or a restarting trainer) that disagrees stops.
- The model's config and tokenizer files (``model/``): a worker needs only the bucket URL and run id.

Keys come from ``stoa.layout``. Rollout records (the other half of the bucket contract) are in
``stoa.rollouts.records``. This module imports neither torch nor mlx.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import xxhash

from stoa.bucket import Bucket, ObjectExists, ObjectNotFound
from stoa.layout import contract_key, model_file_key, model_prefix
from stoa.untrusted import (
    BadBucketObject,
    as_object,
    check_int,
    check_number,
    check_text,
    field_int,
    field_object,
    field_text,
    int_list,
    loads_bounded,
)
from stoa.weights.adapter import AdapterSpec
from stoa.weights.ed25519 import CONTRACT_DOMAIN, PUBLIC_HEX, is_hex, signature_problem
from stoa.weights.planes import ADAPTER_PLANE, INT4_PLANE

SCHEMA_VERSION = 1
"""Version of the contract and of every record type; bump on any incompatible change."""
MAX_CONTRACT_BYTES = 1 << 20
"""Longest ``run.json`` read (a real one is about 2 KB)."""
MAX_CONTRACT_DEPTH = 16
"""Deepest nesting of ``run.json`` read (task knobs and the algorithm are small objects)."""
MAX_SAMPLES = 4096
"""Largest group size n a contract may set (a record holds at most this many samples)."""
MAX_NEW_TOKENS = 1 << 20
"""Largest completion length a contract may set."""
MAX_VOCAB = 1 << 24
"""Largest vocabulary a contract may name."""
MAX_WINDOW = 1 << 20
"""Largest staleness bound or reuse cap a contract may set."""
CONTRACT_FIX = "the trainer did not write it; restore it from a backup of the bucket, or start a new --run"
"""The fix a refused ``run.json`` names."""


def canonical_json(obj: Any) -> bytes:
    """Serialise ``obj`` as canonical JSON (sorted keys, no spaces) for hashing."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def digest_hex(data: bytes) -> str:
    """Return the hex xxh3-128 digest used for fingerprints."""
    return xxhash.xxh3_128_hexdigest(data)


class RunNotFound(LookupError):
    """The bucket holds no such run; the message names the run, the bucket and the fix (``stoa runs``)."""


class ContractMismatch(RuntimeError):
    """A worker or trainer found a run contract that disagrees with its own view.

    Args:
        fields: names of the mismatching fields (dotted paths).
        detail: a human-readable explanation.
    """

    def __init__(self, fields: Sequence[str], detail: str = ""):
        self.fields = list(fields)
        msg = "run contract mismatch in field(s): " + ", ".join(self.fields)
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class RunKeyError(ContractMismatch):
    """The run's key is missing, malformed, or not the one this client trusts (exit 3, one line).

    Args:
        detail: what is wrong and the fix.
    """

    def __init__(self, detail: str) -> None:
        super().__init__(["run_key"], detail)


@dataclass(frozen=True)
class ModelSpec:
    """What both sides must agree on about the model."""

    architecture: str
    """Model type from config.json (e.g. ``llama``)."""
    config_hash: str
    """Hash of the config fields that change what the model computes (rope theta, norms, ties...)."""
    tokenizer_hash: str
    """Hash of the tokenizer's vocabulary, merges, special tokens and chat template."""
    vocab_size: int
    """Rows of the embedding matrix; every token id in a record must be below it."""
    base_weights_hash: str | None = None
    """Hash of the base checkpoint the run started from (informational)."""
    eos_token_ids: tuple[int, ...] = ()
    """Token ids that end a completion."""


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling defaults every worker uses."""

    temperature: float = 1.0
    """Logits are divided by this before softmax; the trainer uses the same value."""
    top_p: float = 1.0
    """Nucleus mass; 1.0 keeps the full distribution (the trainer's ratios are then exact)."""
    max_new_tokens: int = 64
    """Completion length cap; longer completions end with finish reason ``length``."""


@dataclass(frozen=True)
class RunContract:
    """Everything workers and the trainer must agree on. Written once by the trainer."""

    run_id: str
    """Run name (``STOA_RUN``)."""
    model: ModelSpec
    """Model architecture and fingerprints."""
    n_samples: int
    """Group size n (``STOA_N_SAMPLES``); records with another n are dropped."""
    plane: str
    """Weight plane: ``bf16`` or ``int8g64`` (``STOA_PLANE``); a LoRA run's base may also be ``int4g64``."""
    task_id: str
    """Task name (``arithmetic``, ``gsm8k``)."""
    task_spec: Mapping[str, Any]
    """Task knobs; prompt ids are only meaningful together with them."""
    reward_version: str
    """Version of the task's reward function."""
    sampling: SamplingSpec
    """Sampling defaults."""
    staleness_bound: int = 3
    """Records older than ``current - staleness_bound`` are not used (informational for workers)."""
    reuse_cap: int = 2
    """A record is used in at most this many optimizer steps (informational for workers)."""
    algorithm: Mapping[str, Any] = field(default_factory=dict)
    """Algorithm name and knobs (informational for workers)."""
    retriever: Mapping[str, Any] = field(default_factory=dict)
    """Search tasks: the index every worker and the trainer search (``fingerprint``, under
    ``runs/<run>/retriever/<fingerprint>/``) and the tool's settings (``k``); empty for other tasks."""
    task_code: tuple[Mapping[str, str], ...] = ()
    """The task plugin code every machine must run (``stoa.tasks.code``): per module ``module``, ``dist``,
    ``version`` and ``sha256`` of its source; empty for built-in tasks."""
    adapter: Mapping[str, Any] = field(default_factory=dict)
    """A LoRA run's adapter plane (``stoa.weights.adapter.AdapterSpec.to_dict``): the base's identity and the
    state hash of its published anchor, the adapter's rank, alpha and targets; the pointer then names plane
    ``adapter`` and ``plane`` is the base's. Empty for full fine-tuning (the pointer names ``plane``)."""
    schema_version: int = SCHEMA_VERSION
    """Schema version of records and weights."""
    created_at: float = 0.0
    """Unix time the trainer wrote the contract."""
    run_key: str = ""
    """The run's Ed25519 public key (64 hex digits): every pointer is signed by its private half, which only
    the trainer holds; "" for a run without a key (``sign_weights = false``)."""
    signature: str = ""
    """The run key's signature over :meth:`signed_bytes` (128 hex digits; "" without a key)."""

    def _fields(self) -> dict[str, Any]:
        d = asdict(self)
        if not self.task_code:
            d.pop("task_code")  # a built-in task writes the same run.json as before plugins existed
        if not self.adapter:
            d.pop("adapter")  # full fine-tuning writes the same run.json as before adapter planes existed
        if not self.run_key and not self.signature:
            d.pop("run_key")  # a run without a key writes the same run.json as before keys existed
            d.pop("signature")
        return d

    def to_json(self) -> bytes:
        """Encode as canonical JSON."""
        return canonical_json(self._fields())

    def signed_bytes(self) -> bytes:
        """What the run key signs: a domain prefix and the canonical JSON of every field but the signature."""
        d = self._fields()
        d.pop("signature", None)
        d.setdefault("run_key", "")
        return CONTRACT_DOMAIN + canonical_json(d)

    def check_signature(self) -> RunContract:
        """``self`` if it has no key, or its signature verifies against the key it carries (self-consistency
        only: a client pins the key, see ``stoa.weights.signing.trusted_run_key``).

        Raises:
            ContractMismatch: (``RunKeyError``) a key without a valid signature, or a signature without a key.
        """
        if not self.run_key:
            if self.signature:
                raise RunKeyError("run.json has a signature but no run_key; the contract was tampered with")
            return self
        if not is_hex(self.run_key, PUBLIC_HEX):
            raise RunKeyError(f"run.json's run_key is not an Ed25519 public key ({PUBLIC_HEX} lowercase hex digits)")
        problem = signature_problem(self.run_key, self.signature, self.signed_bytes())
        if problem is not None and problem[0] == "no_cryptography":  # pragma: no cover - install without it
            raise RunKeyError(problem[1])
        if problem is not None:
            raise RunKeyError(f"run.json of run {self.run_id!r} is not signed by the key it carries "
                              f"({problem[0]}: {problem[1]}); the contract was tampered with")
        return self

    @classmethod
    def from_json(cls, data: bytes, key: str = "run.json") -> RunContract:
        """Decode and type-check a contract (``stoa.untrusted``: bounded size, depth and numbers, exact types).

        Anyone with bucket credentials can write ``run.json``, and nothing works without it, so a malformed one
        stops the client with one line (``BadBucketObject``, exit 13): a worker never samples for a contract it
        cannot read. Every number that something is sized by is bounded (group size, token budget, vocabulary).

        Args:
            data: the bytes of ``run.json``.
            key: the object's key, for the message.

        Raises:
            ContractMismatch: on a schema version this code does not speak; ``RunKeyError`` when a signed
                contract does not verify against the key it carries (:meth:`check_signature`).
            BadBucketObject: (a ``ValueError``) malformed JSON, a missing, unknown or mistyped field.
        """
        try:
            d = as_object(loads_bounded(data, max_bytes=MAX_CONTRACT_BYTES, max_depth=MAX_CONTRACT_DEPTH), "it")
        except ValueError as e:
            raise BadBucketObject(key, f"is not a run contract ({e})", CONTRACT_FIX) from None
        version = d.get("schema_version")
        if type(version) is not int or version != SCHEMA_VERSION:
            raise ContractMismatch(["schema_version"],
                                   f"run has {repr(version)[:40]}, this stoa speaks {SCHEMA_VERSION}")
        try:
            contract = _contract_fields(cls, d)
        except ValueError as e:
            raise BadBucketObject(key, f"is not a run contract ({str(e)[:300]})", CONTRACT_FIX) from None
        return contract.check_signature()

    @property
    def adapter_spec(self) -> AdapterSpec | None:
        """The adapter plane's spec (None for full fine-tuning)."""
        return AdapterSpec.from_dict(dict(self.adapter)) if self.adapter else None

    @property
    def weight_plane(self) -> str:
        """The plane the weight pointer names: ``adapter`` for a LoRA run, else ``plane``."""
        return ADAPTER_PLANE if self.adapter else self.plane

    def fingerprint(self) -> str:
        """Hash of the fields a record depends on (not timestamps, not the signature); records carry it."""
        d = self._fields()
        d.pop("created_at", None)
        d.pop("signature", None)
        return digest_hex(canonical_json(d))[:16]

    def mismatches(self, other: RunContract) -> list[str]:
        """Return the dotted names of fields that differ from ``other`` (ignoring ``created_at`` and the
        signature, which covers it)."""
        a, b = asdict(self), asdict(other)
        for d in (a, b):
            d.pop("created_at", None)
            d.pop("signature", None)
        return _diff_fields(a, b, "")


def _contract_fields(cls: type[RunContract], d: dict[str, Any]) -> RunContract:
    """Every field of a parsed contract, type-checked and bounded; ``ValueError`` naming the first bad one."""
    unknown = sorted(set(d) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"unknown fields {unknown[:5]}")
    model = as_object(d.get("model"), "model")
    vocab = field_int(model, "vocab_size", lo=1, hi=MAX_VOCAB)
    base = model.get("base_weights_hash")
    if sorted(set(model) - {f.name for f in fields(ModelSpec)}):
        raise ValueError("model has unknown fields")
    spec = ModelSpec(architecture=field_text(model, "architecture", max_len=128),
                     config_hash=field_text(model, "config_hash", max_len=128),
                     tokenizer_hash=field_text(model, "tokenizer_hash", max_len=128), vocab_size=vocab,
                     base_weights_hash=None if base is None else check_text(base, "base_weights_hash", max_len=128),
                     eos_token_ids=tuple(int_list(model.get("eos_token_ids", []), "eos_token_ids", max_len=64,
                                                  hi=vocab - 1)))
    samp = field_object(d, "sampling", max_items=3)
    if sorted(set(samp) - {f.name for f in fields(SamplingSpec)}):
        raise ValueError("sampling has unknown fields")
    sampling = SamplingSpec(temperature=check_number(samp.get("temperature", 1.0), "temperature", lo=1e-30, hi=1e6),
                            top_p=check_number(samp.get("top_p", 1.0), "top_p", lo=1e-30, hi=1.0),
                            max_new_tokens=check_int(samp.get("max_new_tokens", 64), "max_new_tokens", lo=1,
                                                     hi=MAX_NEW_TOKENS))
    return cls(run_id=field_text(d, "run_id", max_len=256), model=spec,
               n_samples=field_int(d, "n_samples", lo=1, hi=MAX_SAMPLES), plane=field_text(d, "plane", max_len=32),
               task_id=field_text(d, "task_id", max_len=128), task_spec=field_object(d, "task_spec"),
               reward_version=field_text(d, "reward_version", max_len=128), sampling=sampling,
               staleness_bound=check_int(d.get("staleness_bound", 3), "staleness_bound", hi=MAX_WINDOW),
               reuse_cap=check_int(d.get("reuse_cap", 2), "reuse_cap", hi=MAX_WINDOW),
               algorithm=field_object(d, "algorithm", default={}), retriever=field_object(d, "retriever", default={}),
               task_code=_task_code(d.get("task_code", [])),
               adapter=_adapter(d),
               schema_version=SCHEMA_VERSION, created_at=check_number(d.get("created_at", 0.0), "created_at", lo=0),
               run_key=check_text(d.get("run_key", ""), "run_key", max_len=128),
               signature=check_text(d.get("signature", ""), "signature", max_len=256))


TASK_CODE_KEYS = ("module", "dist", "version", "sha256")
"""The fields of one ``task_code`` entry."""


def _task_code(value: Any) -> tuple[dict[str, str], ...]:
    """The ``task_code`` field: at most 16 objects with exactly ``TASK_CODE_KEYS``, each a short string."""
    if not isinstance(value, list) or len(value) > 16:
        raise ValueError("task_code must be a list of at most 16 objects")
    out = []
    for i, item in enumerate(value):
        d = as_object(item, f"task_code[{i}]")
        if sorted(d) != sorted(TASK_CODE_KEYS):
            raise ValueError(f"task_code[{i}] must have exactly the keys {list(TASK_CODE_KEYS)}")
        out.append({k: check_text(d[k], f"task_code[{i}].{k}", max_len=128) for k in TASK_CODE_KEYS})
    return tuple(out)


def _diff_fields(a: Any, b: Any, path: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for k in sorted(set(a) | set(b)):
            out += _diff_fields(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
        return out
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return [] if list(a) == list(b) else [path]
    return [] if a == b else [path]


MODEL_FILE_SUFFIXES = (".json", ".jinja", ".txt", ".model")
"""Non-weight files of a model directory that workers download from the bucket."""
MAX_MODEL_FILE_BYTES = 1 << 30
"""Largest model file downloaded (tokenizers are tens of MB)."""
MAX_MODEL_JSON_DEPTH = 64
"""Deepest nesting of a model ``.json`` file read (a tokenizer's pipeline is about 6 deep)."""
_MODEL_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def upload_model_files(bucket: Bucket, run_id: str, model_dir: Path) -> list[str]:
    """Upload config and tokenizer files (not weights) so workers need nothing but the bucket.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        model_dir: the base model directory.
    """
    keys = []
    for f in sorted(Path(model_dir).iterdir()):
        if f.is_file() and f.suffix in MODEL_FILE_SUFFIXES:
            key = model_file_key(run_id, f.name)
            try:
                bucket.put_create(key, f.read_bytes())
            except ObjectExists as e:
                raise ContractMismatch(["model"], f"{key} exists with other content") from e
            keys.append(key)
    return keys


def _model_files(bucket: Bucket, prefix: str) -> dict[str, int]:
    """File name -> listed size of the model files directly under the model prefix: plain names with a model file
    suffix only (no sub-keys, no dot files, nothing a local path could misread)."""
    return {name: info.size for info in bucket.list(prefix)
            if _MODEL_FILE.fullmatch(name := info.key[len(prefix):]) and name.endswith(MODEL_FILE_SUFFIXES)}


def _model_file(bucket: Bucket, key: str, size: int) -> bytes:
    """A model file's bytes, refused (``BadBucketObject``) when listed over the cap, or when a ``.json`` one is not
    JSON that the readers after it (transformers, the fingerprints) can parse without recursing too deep."""
    fix = "the trainer uploads the model's files once; restore them from the model, or start a new --run"
    if size > MAX_MODEL_FILE_BYTES:
        raise BadBucketObject(key, f"is listed at {size} bytes (> {MAX_MODEL_FILE_BYTES})", fix)
    data = bucket.get(key)
    if key.endswith(".json"):
        try:
            loads_bounded(data, max_bytes=MAX_MODEL_FILE_BYTES, max_depth=MAX_MODEL_JSON_DEPTH)
        except ValueError as e:
            raise BadBucketObject(key, f"is not a model file ({str(e)[:200]})", fix) from None
    return data


def model_files_ready(names: list[str]) -> bool:
    """Whether a model file listing is usable: ``config.json`` and ``tokenizer.json`` (fast tokenizers only).

    Args:
        names: file names under ``runs/<run>/model/``.
    """
    return "config.json" in names and "tokenizer.json" in names


def download_model_files(bucket: Bucket, run_id: str, dest: Path, timeout_s: float = 0.0, poll_s: float = 1.0,
                         echo=print) -> Path:
    """Fetch the run's config and tokenizer files into ``dest`` (used by workers and tools).

    Waits up to ``timeout_s`` for them to appear (``config.json`` and ``tokenizer.json``): a worker may
    see the contract of a trainer that is still starting, so it waits for the model files like it
    waits for the contract, with one note line.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        dest: local directory to fill.
        timeout_s: how long to wait for the files (0: look once).
        poll_s: wait between looks.
        echo: where the waiting note goes.

    Raises:
        ObjectNotFound: no usable model files after ``timeout_s``; names the prefix and the fix.
        BadBucketObject: a file listed over 1 GiB, or a ``.json`` file that is not bounded JSON (nested over 64
            deep, not UTF-8, NaN...): written by someone else, it would crash or exhaust the reader after this.
    """
    prefix = model_prefix(run_id)
    deadline = time.monotonic() + timeout_s
    noted = False
    while not model_files_ready(list(files := _model_files(bucket, prefix))):
        if time.monotonic() >= deadline:
            raise ObjectNotFound(f"run {run_id!r} has no model files (config.json and tokenizer.json) under {prefix} "
                                 f"after {timeout_s:.0f}s; start the trainer, or pass --model DIR")
        if not noted:
            echo(f"[worker] waiting for the model files of run {run_id!r} under {prefix}")
            noted = True
        time.sleep(poll_s)
    dest.mkdir(parents=True, exist_ok=True)
    for name, size in files.items():
        (dest / name).write_bytes(_model_file(bucket, prefix + name, size))
    return dest


def wait_for_contract(bucket: Bucket, run_id: str, timeout_s: float, poll_s: float = 1.0, echo=print) -> RunContract:
    """Read the run contract, waiting up to ``timeout_s`` for a trainer to write it.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        timeout_s: how long to wait.
        poll_s: wait between attempts.
        echo: where the waiting note goes.
    """
    deadline = time.monotonic() + timeout_s
    noted = False
    while True:
        try:
            return RunContract.from_json(bucket.get(contract_key(run_id)), contract_key(run_id))
        except ObjectNotFound:
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {run_id!r} has no contract in {bucket.url} after {timeout_s:.0f}s; "
                                   "start the trainer first or check --run/--bucket") from None
            if not noted:
                echo(f"[worker] waiting for run {run_id!r} to appear in {bucket.url}")
                noted = True
            time.sleep(poll_s)


def _adapter(d: dict[str, Any]) -> dict[str, Any]:
    """A contract's ``adapter`` object, checked; a 4-bit ``plane`` is a LoRA base's only.

    Args:
        d: the parsed contract.

    Raises:
        ValueError: a malformed adapter, or plane ``int4g64`` without one.
    """
    if "adapter" in d:
        return AdapterSpec.from_dict(d["adapter"]).to_dict()
    if d.get("plane") == INT4_PLANE:
        raise ValueError(f"plane {INT4_PLANE} is a LoRA run's base plane: the contract has no adapter")
    return {}
