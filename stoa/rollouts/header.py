"""The JSON header of a rollout record: bounded, strictly typed parsing (``stoa.rollouts.records`` uses it).

Every failure is a ``ValueError`` naming the field; the record decoder files it as ``malformed``.
Version 2 headers add per sample ``turns`` (turn starts), ``calls`` (``[name, arguments, digest]``) and
``end`` (the end reason), and ``env_seed`` per record. This module imports neither torch nor mlx.
"""

from __future__ import annotations

from dataclasses import dataclass

from stoa.rollouts.episode import ToolCall
from stoa.untrusted import field_float, field_int, field_number_map, field_str, loads_bounded

MAX_RECORD_BYTES = 64 * 1024 * 1024
"""Records larger than this are rejected before decoding (``oversize``)."""
MAX_TURNS = 64
"""Most turn starts, and most tool calls, one sample may declare."""
MAX_ARGUMENT_CHARS = 4096
"""Longest tool-call argument text a record may carry."""
MAX_DIGEST_CHARS = 64
"""Longest tool name or result digest a record may carry."""
MAX_HEADER_BYTES = 1 << 20
"""Longest JSON header accepted (a header describes one group: ids, lengths, rewards)."""
MAX_SAMPLES = 4096
"""Most samples a record may declare (group sizes are far smaller)."""


@dataclass(frozen=True)
class SampleMeta:
    """One sample's header entry."""

    length: int
    reward: float
    finish: str
    turns: tuple[int, ...] = ()
    calls: tuple[ToolCall, ...] = ()
    digests: tuple[str, ...] = ()
    end: str = ""


@dataclass(frozen=True)
class Header:
    """A record's parsed header."""

    worker_id: str
    seq: int
    policy_version: int
    contract_fingerprint: str
    task_id: str
    prompt_id: str
    prompt_len: int
    samples: list[SampleMeta]
    sampling: dict[str, float]
    timings: dict[str, float]
    created_at: float
    env_seed: int


def parse_header(raw: bytes, schema: int) -> Header:
    """Parse and type-check a record header; raises ``ValueError`` only (bounded JSON, strict types).

    Args:
        raw: the header's bytes.
        schema: the record's schema version (1, 2, or 3: version 2 signed).
    """
    h = loads_bounded(raw, max_bytes=MAX_HEADER_BYTES, max_depth=3 if schema == 1 else 5)
    if not isinstance(h, dict):
        raise ValueError("header must be a JSON object")
    metas = h.get("samples")
    if not isinstance(metas, list) or len(metas) > MAX_SAMPLES:
        raise ValueError(f"samples must be a list of at most {MAX_SAMPLES}")
    samples = [_parse_sample(m, schema) for m in metas]
    return Header(
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
        env_seed=field_int(h, "env_seed") if schema >= 2 else 0,
    )


def _parse_sample(m: object, schema: int) -> SampleMeta:
    """One sample's header entry; version 2 adds ``turns``, ``calls`` and ``end`` (all required)."""
    if not isinstance(m, dict):
        raise ValueError("each sample must be an object")
    length, reward = field_int(m, "len", hi=MAX_RECORD_BYTES), field_float(m, "reward")
    finish = field_str(m, "finish", max_len=32)
    if schema == 1:
        return SampleMeta(length, reward, finish)
    turns = m.get("turns")
    if (not isinstance(turns, list) or len(turns) > MAX_TURNS
            or not all(type(t) is int and 0 <= t <= MAX_RECORD_BYTES for t in turns)):
        raise ValueError(f"turns must be a list of at most {MAX_TURNS} token indices")
    calls = m.get("calls")
    if not isinstance(calls, list) or len(calls) > MAX_TURNS or not all(_is_call(c) for c in calls):
        raise ValueError(f"calls must be a list of at most {MAX_TURNS} [name, arguments, digest] strings "
                         f"(name and digest <= {MAX_DIGEST_CHARS}, arguments <= {MAX_ARGUMENT_CHARS} characters)")
    return SampleMeta(length, reward, finish, tuple(turns), tuple(ToolCall(c[0], c[1]) for c in calls),
                       tuple(c[2] for c in calls), field_str(m, "end", max_len=32))


def _is_call(c: object) -> bool:
    """A ``[name, arguments, digest]`` list of bounded strings."""
    return (isinstance(c, list) and len(c) == 3 and all(isinstance(x, str) for x in c)
            and len(c[0]) <= MAX_DIGEST_CHARS and len(c[1]) <= MAX_ARGUMENT_CHARS and len(c[2]) <= MAX_DIGEST_CHARS)
