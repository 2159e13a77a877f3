"""The run's set-up objects, written once by the trainer before anything else and read by every worker.

- ``RunContract`` (``run.json``): what both sides must agree on (model fingerprints, group size, plane,
  task, sampling); create-only, written first; a worker (or a restarting trainer) that disagrees stops.
- The model's config and tokenizer files (``model/``): a worker needs only the bucket URL and run id.

Keys come from ``stoa.layout``. Rollout records (the other half of the bucket contract) are in
``stoa.records``. This module imports neither torch nor mlx.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from stoa.bucket import Bucket, ObjectExists, ObjectNotFound
from stoa.layout import contract_key, is_file_name, model_file_key, model_prefix

SCHEMA_VERSION = 1
"""Version of the contract and of every record type; bump on any incompatible change."""


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
    """Weight plane: ``bf16`` or ``int8g64`` (``STOA_PLANE``)."""
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
        if not self.run_key and not self.signature:
            d.pop("run_key")  # a run without a key writes the same run.json as before keys existed
            d.pop("signature")
        return d

    def to_json(self) -> bytes:
        """Encode as canonical JSON."""
        return canonical_json(self._fields())

    def signed_bytes(self) -> bytes:
        """What the run key signs: a domain prefix and the canonical JSON of every field but the signature."""
        d = asdict(self)
        d.pop("signature")
        return b"stoa.contract/1\n" + canonical_json(d)

    def check_signature(self) -> RunContract:
        """``self`` if it has no key, or its signature verifies against the key it carries (self-consistency
        only: a client pins the key, see ``stoa.weights.signing.trusted_run_key``).

        Raises:
            ContractMismatch: (``RunKeyError``) a key without a valid signature, or a signature without a key.
        """
        from stoa.weights.signing import RunKeyError, check_public_key, signature_problem

        if not self.run_key:
            if self.signature:
                raise RunKeyError("run.json has a signature but no run_key; the contract was tampered with")
            return self
        check_public_key(self.run_key, "run.json's run_key")
        problem = signature_problem(self.run_key, self.signature, self.signed_bytes())
        if problem is not None:
            raise RunKeyError(f"run.json of run {self.run_id!r} is not signed by the key it carries "
                              f"({problem[0]}: {problem[1]}); the contract was tampered with")
        return self

    @classmethod
    def from_json(cls, data: bytes) -> RunContract:
        """Decode and type-check a contract.

        Args:
            data: the bytes of ``run.json``.

        Raises:
            ContractMismatch: on a schema version this code does not speak; ``RunKeyError`` when a signed
                contract does not verify against the key it carries (:meth:`check_signature`).
            ValueError: on malformed JSON or missing fields.
        """
        try:
            d = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"run.json is not valid JSON: {e}") from e
        if not isinstance(d, dict):
            raise ValueError("run.json must hold a JSON object")
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ContractMismatch(
                ["schema_version"], f"run has {d.get('schema_version')!r}, this stoa speaks {SCHEMA_VERSION}"
            )
        try:
            model = dict(d.pop("model"))
            model["eos_token_ids"] = tuple(model.get("eos_token_ids", ()))
            sampling = d.pop("sampling")
            contract = cls(model=ModelSpec(**model), sampling=SamplingSpec(**sampling), **d)
        except (KeyError, TypeError) as e:
            raise ValueError(f"run.json is missing or has unknown fields: {e}") from e
        return contract.check_signature()

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


def _model_names(bucket: Bucket, prefix: str) -> list[str]:
    """File names directly under the model prefix (no sub-keys, no dot files, no foreign names)."""
    names = []
    for info in bucket.list(prefix):
        name = info.key[len(prefix):]
        if is_file_name(name):
            names.append(name)
    return names


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
    """
    prefix = model_prefix(run_id)
    deadline = time.monotonic() + timeout_s
    noted = False
    while not model_files_ready(names := _model_names(bucket, prefix)):
        if time.monotonic() >= deadline:
            raise ObjectNotFound(f"run {run_id!r} has no model files (config.json and tokenizer.json) under {prefix} "
                                 f"after {timeout_s:.0f}s; start the trainer, or pass --model DIR")
        if not noted:
            echo(f"[worker] waiting for the model files of run {run_id!r} under {prefix}")
            noted = True
        time.sleep(poll_s)
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        (dest / name).write_bytes(bucket.get(prefix + name))
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
            return RunContract.from_json(bucket.get(contract_key(run_id)))
        except ObjectNotFound:
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {run_id!r} has no contract in {bucket.url} after {timeout_s:.0f}s; "
                                   "start the trainer first or check --run/--bucket") from None
            if not noted:
                echo(f"[worker] waiting for run {run_id!r} to appear in {bucket.url}")
                noted = True
            time.sleep(poll_s)
