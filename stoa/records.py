"""Rollout records: what a worker writes per prompt group, its binary codec and the trainer's validation.

A ``RolloutRecord`` lives at ``stoa.layout.rollout_key`` (``rollouts/v<version>/<worker>-<seq>.rec``):
written create-only by workers, one per prompt group; read by the trainer, which treats it as
untrusted input (``RolloutRecord.decode`` checks framing and digest, ``validate_record`` checks it
against the run contract). The contract itself is in ``stoa.contract``; the weight pointer, anchors
and patches in ``stoa.weights`` (see docs/weights.md).

This module imports neither torch nor mlx: both kinds of worker and the trainer use it.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field

import numpy as np
import xxhash

from stoa.contract import SCHEMA_VERSION, RunContract
from stoa.untrusted import field_float, field_int, field_number_map, field_str, loads_bounded

__all__ = [
    "FINISH_REASONS",
    "MAX_HEADER_BYTES",
    "MAX_RECORD_BYTES",
    "MAX_SAMPLES",
    "RECORD_MAGIC",
    "REJECT_REASONS",
    "RecordRejected",
    "RolloutRecord",
    "Sample",
    "validate_record",
]

RECORD_MAGIC = b"STOAREC\x00"
_PREFIX = struct.Struct("<8sHHI")  # magic, schema version, reserved, header length
_DIGEST_LEN = 16
MAX_RECORD_BYTES = 64 * 1024 * 1024
"""Records larger than this are rejected before decoding (``oversize``)."""

FINISH_REASONS = ("stop", "length")


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
