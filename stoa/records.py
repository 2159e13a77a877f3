"""The bucket contract: every object type the two sides exchange, its schema version and codec.

Who writes and who reads each type:

- ``RunContract`` (``runs/<run>/run.json``): written once, create-only, by the trainer before
  the first anchor; read and verified by every worker (and by a restarting trainer).
- ``RolloutRecord`` (``runs/<run>/rollouts/v<version>/<worker>-<seq>.rec``): written
  create-only by workers, one per prompt group; read by the trainer, which treats it as
  untrusted input (``validate_record``).
- The weight pointer, anchors and patches (``runs/<run>/weights/...``) are written by the
  trainer and read by workers; their byte layout lives in ``stoa.weights`` (see docs/weights.md).

This module imports neither torch nor mlx: both kinds of worker and the trainer use it.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import xxhash

from stoa.untrusted import field_float, field_int, field_number_map, field_str, loads_bounded

SCHEMA_VERSION = 1
"""Version of every record type in this module; bump on any incompatible change."""

RECORD_MAGIC = b"STOAREC\x00"
_PREFIX = struct.Struct("<8sHHI")  # magic, schema version, reserved, header length
_DIGEST_LEN = 16
MAX_RECORD_BYTES = 64 * 1024 * 1024
"""Records larger than this are rejected before decoding (``oversize``)."""

FINISH_REASONS = ("stop", "length")


def run_prefix(run_id: str) -> str:
    """Return the key prefix of a run inside the bucket."""
    return f"runs/{run_id}"


def contract_key(run_id: str) -> str:
    """Return the key of a run's contract."""
    return f"{run_prefix(run_id)}/run.json"


def rollout_version_prefix(run_id: str, version: int) -> str:
    """Return the key prefix under which records sampled at ``version`` live."""
    return f"{run_prefix(run_id)}/rollouts/v{version:08d}/"


def rollout_key(run_id: str, version: int, worker_id: str, seq: int) -> str:
    """Return the key of one rollout record."""
    return f"{rollout_version_prefix(run_id, version)}{worker_id}-{seq:08d}.rec"


_ROLLOUT_NAME = re.compile(r"v([0-9]{8})/([A-Za-z0-9][A-Za-z0-9._-]{0,127})-([0-9]{8})\.rec")


@dataclass(frozen=True)
class RolloutKey:
    """The parts of a well-formed rollout key."""

    version: int
    worker_id: str
    seq: int


def parse_rollout_key(run_id: str, key: str) -> RolloutKey | None:
    """Parse ``runs/<run>/rollouts/v<8 digits>/<worker>-<8 digits>.rec``; ``None`` for any other key.

    Args:
        run_id: the run the key must belong to.
        key: a listed key (untrusted: any string).
    """
    head = f"{run_prefix(run_id)}/rollouts/"
    m = _ROLLOUT_NAME.fullmatch(key[len(head):]) if key.startswith(head) else None
    return RolloutKey(int(m.group(1)), m.group(2), int(m.group(3))) if m else None


def canonical_json(obj: Any) -> bytes:
    """Serialise ``obj`` as canonical JSON (sorted keys, no spaces) for hashing."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def digest_hex(data: bytes) -> str:
    """Return the hex xxh3-128 digest used for fingerprints."""
    return xxhash.xxh3_128_hexdigest(data)


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
    """Run name (``DRL_RUN``)."""
    model: ModelSpec
    """Model architecture and fingerprints."""
    n_samples: int
    """Group size n (``DRL_N_SAMPLES``); records with another n are dropped."""
    plane: str
    """Weight plane: ``bf16`` or ``int8g64`` (``DRL_PULSE_PLANE``)."""
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
    schema_version: int = SCHEMA_VERSION
    """Schema version of records and weights."""
    created_at: float = 0.0
    """Unix time the trainer wrote the contract."""

    def to_json(self) -> bytes:
        """Encode as canonical JSON."""
        return canonical_json(asdict(self))

    @classmethod
    def from_json(cls, data: bytes) -> RunContract:
        """Decode and type-check a contract.

        Args:
            data: the bytes of ``run.json``.

        Raises:
            ContractMismatch: on a schema version this code does not speak.
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
            return cls(model=ModelSpec(**model), sampling=SamplingSpec(**sampling), **d)
        except (KeyError, TypeError) as e:
            raise ValueError(f"run.json is missing or has unknown fields: {e}") from e

    def fingerprint(self) -> str:
        """Hash of the fields a record depends on (not timestamps); records carry it."""
        d = asdict(self)
        d.pop("created_at", None)
        return digest_hex(canonical_json(d))[:16]

    def mismatches(self, other: RunContract) -> list[str]:
        """Return the dotted names of fields that differ from ``other`` (ignoring ``created_at``)."""
        a, b = asdict(self), asdict(other)
        a.pop("created_at", None)
        b.pop("created_at", None)
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


@dataclass
class Sample:
    """One completion of a group."""

    tokens: np.ndarray
    """Completion token ids, int32 [T]."""
    logprobs: np.ndarray
    """Behaviour logprob of each completion token under the distribution sampled from, float32 [T]."""
    reward: float
    """Worker-computed reward (the trainer recomputes it for verifiable tasks)."""
    finish_reason: str
    """``stop`` (EOS) or ``length`` (hit max_new_tokens)."""


@dataclass
class RolloutRecord:
    """One prompt group: written by a worker, read (untrusted) by the trainer."""

    worker_id: str
    seq: int
    policy_version: int
    contract_fingerprint: str
    task_id: str
    prompt_id: str
    prompt_tokens: np.ndarray
    samples: list[Sample]
    sampling: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    created_at: float = 0.0
    schema_version: int = SCHEMA_VERSION

    def encode(self) -> bytes:
        """Encode to the compact binary form (no pickle): prefix, JSON header, arrays, digest."""
        prompt = np.ascontiguousarray(self.prompt_tokens, dtype="<i4")
        header = {
            "worker_id": self.worker_id,
            "seq": int(self.seq),
            "policy_version": int(self.policy_version),
            "contract_fingerprint": self.contract_fingerprint,
            "task_id": self.task_id,
            "prompt_id": self.prompt_id,
            "prompt_len": int(prompt.size),
            "samples": [
                {"len": int(np.asarray(s.tokens).size), "reward": float(s.reward), "finish": s.finish_reason}
                for s in self.samples
            ],
            "sampling": self.sampling,
            "timings": self.timings,
            "created_at": float(self.created_at),
        }
        hbytes = json.dumps(header, separators=(",", ":")).encode()
        parts = [_PREFIX.pack(RECORD_MAGIC, self.schema_version, 0, len(hbytes)), hbytes, prompt.tobytes()]
        for s in self.samples:
            toks = np.ascontiguousarray(s.tokens, dtype="<i4")
            lps = np.ascontiguousarray(s.logprobs, dtype="<f4")
            parts += [toks.tobytes(), lps.tobytes()]
        body = b"".join(parts)
        return body + xxhash.xxh3_128_digest(body)

    @classmethod
    def decode(cls, data: bytes) -> RolloutRecord:
        """Decode bytes into a record, checking framing, digest and declared sizes.

        Args:
            data: the object's bytes.

        Raises:
            RecordRejected: with reason ``oversize``, ``malformed``, ``digest`` or ``schema``.
        """
        if len(data) > MAX_RECORD_BYTES:
            raise RecordRejected("oversize", f"{len(data)} bytes > {MAX_RECORD_BYTES}")
        if len(data) < _PREFIX.size + _DIGEST_LEN:
            raise RecordRejected("malformed", "shorter than the fixed prefix")
        magic, schema, _, hlen = _PREFIX.unpack_from(data)
        if magic != RECORD_MAGIC:
            raise RecordRejected("malformed", "bad magic")
        body, digest = data[:-_DIGEST_LEN], data[-_DIGEST_LEN:]
        if xxhash.xxh3_128_digest(body) != digest:
            raise RecordRejected("digest", "content digest does not match (truncated or corrupted)")
        if schema != SCHEMA_VERSION:
            raise RecordRejected("schema", f"schema version {schema}, expected {SCHEMA_VERSION}")
        if hlen > len(body) - _PREFIX.size:
            raise RecordRejected("malformed", f"header length {hlen} runs past the end")
        try:
            header = _parse_header(body[_PREFIX.size : _PREFIX.size + hlen])
        except ValueError as e:  # the only error the bounded parser and field readers raise
            raise RecordRejected("malformed", f"bad header: {e}") from None
        off = _PREFIX.size + hlen
        plen, lens = header.prompt_len, [m.length for m in header.samples]
        need = plen * 4 + 8 * sum(lens)
        if off + need != len(body):
            raise RecordRejected("length_mismatch", f"declared sizes need {need} payload bytes")
        prompt = np.frombuffer(body, dtype="<i4", count=plen, offset=off).astype(np.int32)
        off += plen * 4
        samples = []
        for m in header.samples:
            toks = np.frombuffer(body, dtype="<i4", count=m.length, offset=off).astype(np.int32)
            off += 4 * m.length
            lps = np.frombuffer(body, dtype="<f4", count=m.length, offset=off).astype(np.float32)
            off += 4 * m.length
            samples.append(Sample(toks, lps, m.reward, m.finish))
        return cls(worker_id=header.worker_id, seq=header.seq, policy_version=header.policy_version,
                   contract_fingerprint=header.contract_fingerprint, task_id=header.task_id,
                   prompt_id=header.prompt_id, prompt_tokens=prompt, samples=samples,
                   sampling=header.sampling, timings=header.timings, created_at=header.created_at,
                   schema_version=schema)

    def content_id(self) -> str:
        """Identity of the training content: policy version, prompt tokens, sample tokens and logprobs.

        Byte-identical copies under other keys, and copies relabelled with another worker id, seq or
        timings, share it, so the reuse cap counts them as one record.
        """
        h = xxhash.xxh3_128(struct.pack("<qI", self.policy_version, len(self.samples)))
        h.update(np.ascontiguousarray(self.prompt_tokens, dtype="<i4").tobytes())
        for s in self.samples:
            h.update(struct.pack("<I", int(np.asarray(s.tokens).size)))
            h.update(np.ascontiguousarray(s.tokens, dtype="<i4").tobytes())
            h.update(np.ascontiguousarray(s.logprobs, dtype="<f4").tobytes())
        return h.hexdigest()


MAX_HEADER_BYTES = 1 << 20
"""Longest JSON header accepted (a header describes one group: ids, lengths, rewards)."""
MAX_SAMPLES = 4096
"""Most samples a record may declare (group sizes are far smaller)."""


@dataclass(frozen=True)
class _SampleMeta:
    length: int
    reward: float
    finish: str


@dataclass(frozen=True)
class _Header:
    worker_id: str
    seq: int
    policy_version: int
    contract_fingerprint: str
    task_id: str
    prompt_id: str
    prompt_len: int
    samples: list[_SampleMeta]
    sampling: dict[str, float]
    timings: dict[str, float]
    created_at: float


def _parse_header(raw: bytes) -> _Header:
    """Parse and type-check a record header; raises ``ValueError`` only (bounded JSON, strict types)."""
    h = loads_bounded(raw, max_bytes=MAX_HEADER_BYTES, max_depth=3)
    if not isinstance(h, dict):
        raise ValueError("header must be a JSON object")
    metas = h.get("samples")
    if not isinstance(metas, list) or len(metas) > MAX_SAMPLES:
        raise ValueError(f"samples must be a list of at most {MAX_SAMPLES}")
    samples = []
    for m in metas:
        if not isinstance(m, dict):
            raise ValueError("each sample must be an object")
        samples.append(_SampleMeta(field_int(m, "len", hi=MAX_RECORD_BYTES), field_float(m, "reward"),
                                   field_str(m, "finish", max_len=32)))
    return _Header(
        worker_id=field_str(h, "worker_id", max_len=128),
        seq=field_int(h, "seq"),
        policy_version=field_int(h, "policy_version", hi=2**31),
        contract_fingerprint=field_str(h, "contract_fingerprint", max_len=64),
        task_id=field_str(h, "task_id", max_len=128),
        prompt_id=field_str(h, "prompt_id", max_len=256),
        prompt_len=field_int(h, "prompt_len", hi=MAX_RECORD_BYTES),
        samples=samples,
        sampling=field_number_map(h, "sampling"),
        timings=field_number_map(h, "timings"),
        created_at=field_float(h, "created_at", bound=1e12, default=0.0),
    )


class RecordRejected(ValueError):
    """A rollout record failed validation; ``reason`` is the counter it is filed under.

    Args:
        reason: one of ``REJECT_REASONS``.
        detail: human-readable detail.
    """

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


REJECT_REASONS = (
    "oversize",
    "malformed",
    "digest",
    "schema",
    "length_mismatch",
    "fingerprint",
    "task",
    "group_size",
    "vocab",
    "nonfinite",
    "finish_reason",
    "version",
    "prompt",
    "key",
    "duplicate",
    "quarantined",
)


def validate_record(
    rec: RolloutRecord,
    contract: RunContract,
    *,
    current_version: int | None = None,
    max_prompt_tokens: int = 4096,
) -> None:
    """Check a decoded record against the run contract; raise ``RecordRejected`` on any problem.

    Args:
        rec: the decoded record.
        contract: the run contract.
        current_version: the trainer's version; records claiming a future version are rejected.
        max_prompt_tokens: prompts longer than this are rejected as oversize.
    """
    if rec.contract_fingerprint != contract.fingerprint():
        raise RecordRejected("fingerprint", f"record {rec.contract_fingerprint} != run {contract.fingerprint()}")
    if rec.task_id != contract.task_id:
        raise RecordRejected("task", f"task {rec.task_id!r} != {contract.task_id!r}")
    if len(rec.samples) != contract.n_samples:
        raise RecordRejected("group_size", f"{len(rec.samples)} samples, contract n={contract.n_samples}")
    if rec.policy_version < 1 or (current_version is not None and rec.policy_version > current_version):
        raise RecordRejected("version", f"policy version {rec.policy_version}")
    vocab = contract.model.vocab_size
    if rec.prompt_tokens.size == 0 or rec.prompt_tokens.size > max_prompt_tokens:
        raise RecordRejected("oversize" if rec.prompt_tokens.size else "prompt", "prompt length out of range")
    if rec.prompt_tokens.min() < 0 or rec.prompt_tokens.max() >= vocab:
        raise RecordRejected("vocab", "prompt token id outside the vocabulary")
    max_new = contract.sampling.max_new_tokens
    for i, s in enumerate(rec.samples):
        if s.tokens.size != s.logprobs.size:
            raise RecordRejected("length_mismatch", f"sample {i}: {s.tokens.size} tokens, {s.logprobs.size} logprobs")
        if s.tokens.size == 0 or s.tokens.size > max_new:
            raise RecordRejected("oversize", f"sample {i}: {s.tokens.size} tokens (max_new_tokens={max_new})")
        if s.tokens.min() < 0 or s.tokens.max() >= vocab:
            raise RecordRejected("vocab", f"sample {i}: token id outside the vocabulary")
        if not np.all(np.isfinite(s.logprobs)) or np.any(s.logprobs > 1e-4):
            raise RecordRejected("nonfinite", f"sample {i}: logprobs must be finite and <= 0")
        if not math.isfinite(s.reward):
            raise RecordRejected("nonfinite", f"sample {i}: reward is not finite")
        if s.finish_reason not in FINISH_REASONS:
            raise RecordRejected("finish_reason", f"sample {i}: {s.finish_reason!r}")
