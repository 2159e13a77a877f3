"""Rollout records: what a worker writes per prompt group, its binary codec and the trainer's validation.

A ``RolloutRecord`` lives at ``stoa.layout.rollout_key`` (``rollouts/v<version>/<worker>-<seq>.rec``):
written create-only by workers, one per prompt group; read by the trainer, which treats it as
untrusted input (``RolloutRecord.decode`` checks framing and digest, ``validate_record`` checks it
against the run contract). The contract itself is in ``stoa.contract``; the weight pointer, anchors
and patches in ``stoa.weights`` (see docs/weights.md).

Records have their own schema version (``RECORD_SCHEMA_VERSION``; the contract's ``SCHEMA_VERSION`` is
run.json's). Version 2 adds per-token roles (``stoa.rollouts.episode.ROLE_*``), turn starts, tool calls with their
results' digests, the episode's end reason and the environment seed; writers always write version 2,
readers accept 1 (every token an action) and 2. Version 3 is version 2 signed: the worker's Ed25519 public key
and its signature over the body (``stoa.identity``) sit between the payload and the digest, so a signed record
is still one create-only object; ``record_signature`` splits them off for the trainer to verify. The framing
(prefix, digest, trailer) is ``stoa.rollouts.framing``'s.

This module imports neither torch nor mlx: both kinds of worker and the trainer use it.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import xxhash

from stoa.contract import RunContract
from stoa.rollouts.episode import END_REASONS, ROLE_ACTION, EpisodeLimits, ToolCall
from stoa.rollouts.framing import (
    PREFIX,
    RECORD_MAGIC,
    RECORD_SCHEMA_VERSION,
    RECORD_SCHEMA_VERSIONS,
    SIGNED_SCHEMA_VERSION,
    RecordRejected,
    RecordSignature,
    frame,
    record_signature,
    unframe,
)
from stoa.rollouts.header import (
    MAX_ARGUMENT_CHARS,
    MAX_DIGEST_CHARS,
    MAX_HEADER_BYTES,
    MAX_RECORD_BYTES,
    MAX_SAMPLES,
    MAX_TURNS,
    parse_header,
)

__all__ = [
    "FINISH_REASONS",
    "MAX_ARGUMENT_CHARS",
    "MAX_DIGEST_CHARS",
    "MAX_HEADER_BYTES",
    "MAX_RECORD_BYTES",
    "MAX_SAMPLES",
    "MAX_TURNS",
    "RECORD_MAGIC",
    "RECORD_SCHEMA_VERSION",
    "RECORD_SCHEMA_VERSIONS",
    "REJECT_REASONS",
    "SIGNED_SCHEMA_VERSION",
    "RecordRejected",
    "RecordSignature",
    "RolloutRecord",
    "Sample",
    "check_episode",
    "record_signature",
    "validate_record",
]

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
    roles: np.ndarray | None = None
    """``stoa.rollouts.episode.ROLE_*`` of each token, uint8 [T]; None: every token is an action (version-1)."""
    turn_starts: list[int] = field(default_factory=list)
    """Index of each model turn's first token (multi-turn samples; empty for single-turn ones)."""
    calls: list[ToolCall] = field(default_factory=list)
    """The tool calls made, in order: one per observation."""
    digests: list[str] = field(default_factory=list)
    """``ToolResult.digest`` of each call's result."""
    end_reason: str = ""
    """Why the episode ended (``stoa.rollouts.episode.END_REASONS``); empty for single-turn samples."""

    def role_array(self) -> np.ndarray:
        """The roles as uint8 [T]: ``roles``, or every token ``ROLE_ACTION`` when there are none."""
        if self.roles is None:
            return np.full(np.asarray(self.tokens).size, ROLE_ACTION, np.uint8)
        return np.asarray(self.roles, np.uint8)


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
    env_seed: int = 0
    """Seed of the samples' environments (``task.make_env(prompt, env_seed)``); 0 for single-turn tasks."""
    schema_version: int = RECORD_SCHEMA_VERSION
    """The layout the record was decoded from; ``encode`` always writes ``RECORD_SCHEMA_VERSION``."""

    def encode(self, sign: Callable[[bytes], bytes] | None = None) -> bytes:
        """Encode to the compact binary form (no pickle): prefix, JSON header, arrays, [signature], digest.

        Per sample the payload holds int32 tokens, float32 logprobs and uint8 roles (all actions when
        ``roles`` is None).

        Args:
            sign: None writes version 2; else version 3, with ``sign(body)`` (``SIGNATURE_TRAILER`` bytes: the
                worker key's public half and its signature, ``stoa.identity.WorkerKey.record_signer``) after the
                payload.
        """
        prompt = np.ascontiguousarray(self.prompt_tokens, dtype="<i4")
        header = {
            "worker_id": self.worker_id,
            "seq": int(self.seq),
            "policy_version": int(self.policy_version),
            "contract_fingerprint": self.contract_fingerprint,
            "task_id": self.task_id,
            "prompt_id": self.prompt_id,
            "prompt_len": int(prompt.size),
            "samples": [_sample_header(s) for s in self.samples],
            "sampling": self.sampling,
            "timings": self.timings,
            "created_at": float(self.created_at),
            "env_seed": int(self.env_seed),
        }
        parts = [prompt.tobytes()]
        for s in self.samples:
            toks = np.ascontiguousarray(s.tokens, dtype="<i4")
            lps = np.ascontiguousarray(s.logprobs, dtype="<f4")
            parts += [toks.tobytes(), lps.tobytes(), s.role_array().tobytes()]
        return frame(json.dumps(header, separators=(",", ":")).encode(), parts, sign)

    @classmethod
    def decode(cls, data: bytes) -> RolloutRecord:
        """Decode bytes into a record, checking framing, digest and declared sizes.

        Args:
            data: the object's bytes.

        Raises:
            RecordRejected: with reason ``oversize``, ``malformed``, ``digest`` or ``schema``.
        """
        f = unframe(data)
        body, schema, hlen = f.body, f.schema, f.header_len
        if hlen > len(body) - PREFIX.size:
            raise RecordRejected("malformed", f"header length {hlen} runs past the end")
        try:
            header = parse_header(body[PREFIX.size : PREFIX.size + hlen], schema)
        except ValueError as e:  # the only error the bounded parser and field readers raise
            raise RecordRejected("malformed", f"bad header: {e}") from None
        off = PREFIX.size + hlen
        plen, lens = header.prompt_len, [m.length for m in header.samples]
        need = plen * 4 + (8 if schema == 1 else 9) * sum(lens)
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
            roles = None
            if schema >= 2:
                roles = np.frombuffer(body, dtype=np.uint8, count=m.length, offset=off).copy()
                off += m.length
            samples.append(Sample(toks, lps, m.reward, m.finish, roles, list(m.turns), list(m.calls),
                                  list(m.digests), m.end))
        return cls(worker_id=header.worker_id, seq=header.seq, policy_version=header.policy_version,
                   contract_fingerprint=header.contract_fingerprint, task_id=header.task_id,
                   prompt_id=header.prompt_id, prompt_tokens=prompt, samples=samples,
                   sampling=header.sampling, timings=header.timings, created_at=header.created_at,
                   env_seed=header.env_seed, schema_version=schema)

    def content_id(self) -> str:
        """Identity of the training content: policy version, prompt tokens, sample tokens, logprobs, roles.

        Byte-identical copies under other keys, copies relabelled with another worker id, seq or timings,
        and the same content in either schema version share it, so the reuse cap counts them as one record.
        A sample whose tokens are all actions hashes as it did before roles existed (journals stay valid);
        any other sets the top bit of its length and hashes its roles too.
        """
        h = xxhash.xxh3_128(struct.pack("<qI", self.policy_version, len(self.samples)))
        h.update(np.ascontiguousarray(self.prompt_tokens, dtype="<i4").tobytes())
        for s in self.samples:
            roles = s.role_array()
            plain = bool(np.all(roles == ROLE_ACTION))
            h.update(struct.pack("<I", int(np.asarray(s.tokens).size) | (0 if plain else 1 << 31)))
            h.update(np.ascontiguousarray(s.tokens, dtype="<i4").tobytes())
            h.update(np.ascontiguousarray(s.logprobs, dtype="<f4").tobytes())
            if not plain:
                h.update(roles.tobytes())
        return h.hexdigest()


def _sample_header(s: Sample) -> dict:
    """The JSON header of one sample (version 2)."""
    return {"len": int(np.asarray(s.tokens).size), "reward": float(s.reward), "finish": s.finish_reason,
            "turns": [int(t) for t in s.turn_starts],
            "calls": [[c.name, c.arguments, d] for c, d in zip(s.calls, s.digests, strict=True)],
            "end": s.end_reason}


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
    "roles",
    "limits",
    "observation",
    "turn_end",
    "recompute",
    "reward_raised",  # the task's reward code raised on this group (stoa.tasks.scoring)
    "reward_timeout",
    "reward_not_finite",
    "reward_wrong_length",
    # stoa.identity: the record's worker key and its identity (never held against the worker id the key names)
    "unsigned",
    "signature",
    "identity_unknown",
    "identity_worker",
    "identity_forged",
    "identity_run",
    "identity_clock",
    "identity_malformed",
    "revoked",
)


def validate_record(
    rec: RolloutRecord,
    contract: RunContract,
    *,
    current_version: int | None = None,
    max_prompt_tokens: int = 4096,
    limits: EpisodeLimits | None = None,
) -> None:
    """Check a decoded record against the run contract; raise ``RecordRejected`` on any problem.

    Args:
        rec: the decoded record.
        contract: the run contract.
        current_version: the trainer's version; records claiming a future version are rejected.
        max_prompt_tokens: prompts longer than this are rejected as oversize.
        limits: the task's episode limits (multi-turn tasks); None: a single-turn task, whose samples must
            be all actions and at most ``max_new_tokens`` long.
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
    cap = contract.sampling.max_new_tokens if limits is None else limits.max_total_tokens
    for i, s in enumerate(rec.samples):
        if s.tokens.size != s.logprobs.size:
            raise RecordRejected("length_mismatch", f"sample {i}: {s.tokens.size} tokens, {s.logprobs.size} logprobs")
        if s.tokens.size == 0 or (limits is None and s.tokens.size > cap):
            raise RecordRejected("oversize", f"sample {i}: {s.tokens.size} tokens (max_new_tokens={cap})")
        if s.tokens.size > cap:
            raise RecordRejected("limits", f"sample {i}: {s.tokens.size} tokens > max_total_tokens={cap}")
        if s.tokens.min() < 0 or s.tokens.max() >= vocab:
            raise RecordRejected("vocab", f"sample {i}: token id outside the vocabulary")
        if not np.all(np.isfinite(s.logprobs)) or np.any(s.logprobs > 1e-4):
            raise RecordRejected("nonfinite", f"sample {i}: logprobs must be finite and <= 0")
        if not math.isfinite(s.reward):
            raise RecordRejected("nonfinite", f"sample {i}: reward is not finite")
        if s.finish_reason not in FINISH_REASONS:
            raise RecordRejected("finish_reason", f"sample {i}: {s.finish_reason!r}")
        check_episode(s, i, limits)


def _runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and lengths of the maximal runs of True in a boolean vector."""
    edges = np.diff(np.concatenate(([0], mask.astype(np.int8), [0])))
    starts = np.flatnonzero(edges == 1)
    return starts, np.flatnonzero(edges == -1) - starts


def check_episode(s: Sample, index: int = 0, limits: EpisodeLimits | None = None) -> None:
    """Check one sample's roles, turns and calls (reason ``roles``) and its episode limits (``limits``).

    Args:
        s: the sample (tokens and logprobs already checked for length, vocabulary and finiteness).
        index: its index in the record, for the message.
        limits: the task's episode limits; None: a single-turn task (every token must be an action).

    Raises:
        RecordRejected: ``roles`` or ``limits`` (``finish_reason`` when it disagrees with the end reason).
    """
    roles = s.role_array()
    where = f"sample {index}"
    if roles.size != s.tokens.size or (roles.size and int(roles.max()) > 2):
        raise RecordRejected("roles", f"{where}: roles must be {s.tokens.size} values in (0, 1, 2)")
    act = roles == ROLE_ACTION
    if not act.any() or not act[0]:
        raise RecordRejected("roles", f"{where}: the first token must be an action (sampled) token")
    if np.any(s.logprobs[~act] != 0):
        raise RecordRejected("roles", f"{where}: an observation token has a nonzero logprob")
    if limits is None:
        if not act.all() or s.calls or s.digests or s.turn_starts not in ([], [0]) or s.end_reason not in (
                ("",) + END_REASONS):
            raise RecordRejected("roles", f"{where}: a single-turn task's samples are one action turn, no calls")
        return
    starts, turn_lens = _runs(act)
    obs_starts, obs_lens = _runs(~act)
    if [int(t) for t in s.turn_starts] != starts.tolist():
        raise RecordRejected("roles", f"{where}: turn starts {s.turn_starts[:8]} are not the action runs' starts")
    if not len(s.calls) == len(s.digests) == obs_starts.size:
        raise RecordRejected("roles", f"{where}: {len(s.calls)} calls, {len(s.digests)} digests for "
                                      f"{obs_starts.size} observations")
    if s.end_reason not in END_REASONS:
        raise RecordRejected("roles", f"{where}: end reason {s.end_reason!r} not in {END_REASONS}")
    if s.finish_reason != ("length" if s.end_reason == "length" else "stop"):
        raise RecordRejected("finish_reason", f"{where}: {s.finish_reason!r} with end reason {s.end_reason!r}")
    if starts.size > limits.max_turns:
        raise RecordRejected("limits", f"{where}: {starts.size} turns > max_turns={limits.max_turns}")
    if turn_lens.max() > limits.max_turn_tokens:
        raise RecordRejected("limits", f"{where}: a turn of {turn_lens.max()} tokens > max_turn_tokens="
                                       f"{limits.max_turn_tokens}")
    if obs_lens.size and obs_lens.max() > limits.max_obs_tokens:
        raise RecordRejected("limits", f"{where}: an observation of {obs_lens.max()} tokens > max_obs_tokens="
                                       f"{limits.max_obs_tokens}")
