"""A rollout record's framing: prefix (magic, schema version, header length), body, the signature trailer of a
signed record, digest. ``unframe`` checks it (size, magic, digest, schema) for ``RolloutRecord.decode`` and for
the trainer's signature check (``record_signature``); ``frame`` seals a body. Pure stdlib and xxhash.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from stoa.rollouts.header import MAX_RECORD_BYTES

RECORD_MAGIC = b"STOAREC\x00"
PREFIX = struct.Struct("<8sHHI")  # magic, schema version, reserved, header length
"""The fixed prefix of every record."""
DIGEST_LEN = 16
"""The xxh3-128 digest that ends every record (over everything before it)."""
RECORD_SCHEMA_VERSION = 2
"""The record layout writers write unsigned (version 2: roles, turns, tool calls, end reason, env seed)."""
SIGNED_SCHEMA_VERSION = 3
"""Version 2 with a signature trailer between the payload and the digest (``stoa.identity``)."""
RECORD_SCHEMA_VERSIONS = (1, 2, SIGNED_SCHEMA_VERSION)
"""Record layouts readers accept."""
SIGNATURE_TRAILER = 96
"""Bytes of a signed record's trailer: a 32-byte Ed25519 public key, then a 64-byte signature of the body."""


class RecordRejected(ValueError):
    """A rollout record failed validation; ``reason`` is the counter it is filed under.

    Args:
        reason: one of ``stoa.rollouts.records.REJECT_REASONS``.
        detail: human-readable detail.
    """

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


@dataclass(frozen=True)
class Frame:
    """A record's framing, checked.

    Attributes:
        schema: the schema version (one of ``RECORD_SCHEMA_VERSIONS``).
        header_len: the JSON header's declared length (not yet checked against the body).
        body: prefix, header and payload: what a signature signs.
        trailer: the signature trailer (``SIGNATURE_TRAILER`` bytes), empty for an unsigned record.
    """

    schema: int
    header_len: int
    body: bytes
    trailer: bytes


def unframe(data: bytes) -> Frame:
    """Check a record's size, magic, digest and schema version and split off its digest and trailer.

    Args:
        data: the object's bytes (untrusted).

    Raises:
        RecordRejected: ``oversize``, ``malformed``, ``digest`` or ``schema``.
    """
    if len(data) > MAX_RECORD_BYTES:
        raise RecordRejected("oversize", f"{len(data)} bytes > {MAX_RECORD_BYTES}")
    if len(data) < PREFIX.size + DIGEST_LEN:
        raise RecordRejected("malformed", "shorter than the fixed prefix")
    magic, schema, _, hlen = PREFIX.unpack_from(data)
    if magic != RECORD_MAGIC:
        raise RecordRejected("malformed", "bad magic")
    body, digest = data[:-DIGEST_LEN], data[-DIGEST_LEN:]
    if xxhash.xxh3_128_digest(body) != digest:
        raise RecordRejected("digest", "content digest does not match (truncated or corrupted)")
    if schema not in RECORD_SCHEMA_VERSIONS:
        raise RecordRejected("schema", f"record schema version {schema}, this stoa reads {RECORD_SCHEMA_VERSIONS}")
    if schema != SIGNED_SCHEMA_VERSION:
        return Frame(schema, hlen, body, b"")
    if len(body) < PREFIX.size + SIGNATURE_TRAILER:
        raise RecordRejected("malformed", "a signed record shorter than its signature")
    return Frame(schema, hlen, body[:-SIGNATURE_TRAILER], body[-SIGNATURE_TRAILER:])


def frame(header: bytes, payload: list[bytes], sign: Callable[[bytes], bytes] | None = None) -> bytes:
    """Seal a record: prefix, header, payload, the trailer ``sign(body)`` makes (version 3) or none (version 2),
    digest.

    Args:
        header: the JSON header.
        payload: the arrays' bytes, in order.
        sign: makes the trailer from the body (``stoa.identity.WorkerKey.record_signer``); None: unsigned.
    """
    schema = RECORD_SCHEMA_VERSION if sign is None else SIGNED_SCHEMA_VERSION
    body = b"".join([PREFIX.pack(RECORD_MAGIC, schema, 0, len(header)), header, *payload])
    if sign is not None:
        trailer = sign(body)
        if len(trailer) != SIGNATURE_TRAILER:
            raise ValueError(f"a record signature trailer is {SIGNATURE_TRAILER} bytes, got {len(trailer)}")
        body += trailer
    return body + xxhash.xxh3_128_digest(body)


@dataclass(frozen=True)
class RecordSignature:
    """A signed record's trailer and the bytes it signs.

    Attributes:
        body: the signed bytes (prefix, header and payload; no trailer, no digest).
        public_key: the signing key's public half (32 bytes).
        signature: the Ed25519 signature (64 bytes).
    """

    body: bytes
    public_key: bytes
    signature: bytes


def record_signature(data: bytes) -> RecordSignature | None:
    """A signed record's trailer and body; None for a record of version 1 or 2 (unsigned).

    Args:
        data: the object's bytes (untrusted).

    Raises:
        RecordRejected: as :func:`unframe`.
    """
    f = unframe(data)
    return RecordSignature(f.body, f.trailer[:32], f.trailer[32:]) if f.trailer else None
