"""Ed25519 signatures as the bucket stores them (hex text), checked without raising.

The primitives under the run contract (``stoa.contract`` verifies ``run.json`` on decoding) and the weights
pointer; ``stoa.weights.signing`` holds the run's key. The cryptography is the ``cryptography`` package's
Ed25519, imported when a signature is checked (a plain install reads unsigned runs without it).
"""

from __future__ import annotations

import re
from typing import Any

PUBLIC_HEX = 64
"""An Ed25519 public key: 32 bytes, written as 64 lowercase hex digits."""
SIGNATURE_HEX = 128
"""An Ed25519 signature: 64 bytes, written as 128 lowercase hex digits."""
POINTER_DOMAIN = b"stoa.weights.pointer/1\n"
"""Prefix of the signed bytes of a pointer (a pointer signature never verifies as a contract's)."""
CONTRACT_DOMAIN = b"stoa.contract/1\n"
"""Prefix of the signed bytes of a contract."""
NO_CRYPTOGRAPHY = "signed runs need the 'cryptography' package: pip install 'stoa[worker]' (or 'stoa[trainer]')"
"""The one line for an install without ``cryptography`` meeting a signed run."""
_HEX = re.compile(r"[0-9a-f]*")


def ed25519() -> Any | None:
    """The ``cryptography`` Ed25519 module, or None on an install without it."""
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519 as module
    except ImportError:  # pragma: no cover - an install without the trainer or worker extra
        return None
    return module


def is_hex(value: Any, digits: int) -> bool:
    """Whether ``value`` is text of exactly ``digits`` lowercase hex digits."""
    return isinstance(value, str) and len(value) == digits and _HEX.fullmatch(value) is not None


def signature_problem(public_hex: str, signature: str, data: bytes) -> tuple[str, str] | None:
    """Why ``signature`` is not ``public_hex``'s signature over ``data`` as (reason, detail); None when it is.

    Reasons: ``unsigned`` (no signature), ``malformed_signature`` (not 128 hex digits), ``bad_signature``
    (made by another key or over other bytes; the two cannot be told apart), ``no_cryptography`` (this install
    cannot check it). Never raises.

    Args:
        public_hex: the trusted public key (64 hex digits).
        signature: the signature as stored (hex), "" when absent.
        data: the exact bytes that were signed.
    """
    if signature == "" or signature is None:
        return "unsigned", "no signature, and the run is signed"
    if not is_hex(signature, SIGNATURE_HEX):
        return "malformed_signature", f"the signature is not {SIGNATURE_HEX} lowercase hex digits"
    if not is_hex(public_hex, PUBLIC_HEX):
        return "malformed_signature", "the run's key is not an Ed25519 public key"
    ed = ed25519()
    if ed is None:  # pragma: no cover - an install without the trainer or worker extra
        return "no_cryptography", NO_CRYPTOGRAPHY
    from cryptography.exceptions import InvalidSignature

    try:
        ed.Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_hex)).verify(bytes.fromhex(signature), data)
    except (InvalidSignature, ValueError):
        return "bad_signature", f"the signature does not verify against the run's key {public_hex[:16]}..."
    return None
