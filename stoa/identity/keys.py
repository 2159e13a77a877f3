"""Worker keys and the statements the run key signs about them (identities, revocations): the data, no I/O
but key files. See ``stoa.identity`` for the scheme."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stoa.contract import RunKeyError
from stoa.untrusted import field_int, field_str, load_object
from stoa.weights.ed25519 import PUBLIC_HEX, ed25519, is_hex, signature_problem

DOMAINS = {"identity": b"stoa.worker_identity/1\n", "revocation": b"stoa.worker_revocation/1\n"}
"""Prefix of a statement's signed bytes, per kind (an identity signature never verifies as a revocation's)."""
RECORD_DOMAIN = b"stoa.record/1\n"
"""Prefix of a record's signed bytes (then the record's bucket key, a newline and its body)."""
MAX_STATEMENT_BYTES = 2048
"""Largest identity or revocation object read (one is about 400 bytes)."""
CLOCK_SKEW_S = 600.0
"""An identity issued further than this in the trainer's future is refused (``identity_clock``) until then."""
IDENTITY_REASONS = ("unsigned", "signature", "identity_unknown", "identity_worker", "identity_forged",
                    "identity_run", "identity_clock", "identity_malformed", "revoked")
"""Rejection reasons of :meth:`IdentityBook.check_record` (also in ``REJECT_REASONS``)."""
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,38}[A-Za-z0-9])?")
_PROCESS_ID = re.compile(r"(?P<name>[A-Za-z0-9._-]+)-[0-9a-f]{6}")


class IdentityError(ValueError):
    """A statement or key that cannot be used; ``reason`` is one of :data:`IDENTITY_REASONS`.

    Args:
        reason: the reason.
        detail: what is wrong (one line).
    """

    def __init__(self, reason: str, detail: str) -> None:
        self.reason, self.detail = reason, detail
        super().__init__(f"{reason}: {detail}")


def check_name(name: str) -> str:
    """``name`` if it can name a worker (1-40 letters, digits, '.', '_', '-'; a letter or digit at each end).

    Args:
        name: the worker name.

    Raises:
        ValueError: one line naming the rule.
    """
    if not _NAME.fullmatch(name):
        raise ValueError(f"worker name {name!r}: use 1-40 letters, digits, '.', '_' or '-', starting and ending "
                         "with a letter or digit")
    return name


def name_of(worker_id: str) -> str | None:
    """The worker name inside a worker process id ``<name>-<6 hex>`` (``stoa.worker.loop.worker_id``), else None.

    Args:
        worker_id: a record key's worker id (untrusted).
    """
    m = _PROCESS_ID.fullmatch(worker_id)
    return m.group("name") if m else None


@dataclass(frozen=True)
class Statement:
    """An identity or a revocation of a worker key, signed by the run key.

    Attributes:
        kind: ``identity`` or ``revocation``.
        run: the run id.
        worker: the worker's name.
        public_key: the worker's Ed25519 public key (64 lowercase hex digits).
        at: when it was issued or revoked (unix seconds, the operator's clock).
        signature: the run key's signature over :meth:`signed_bytes` (128 hex digits).
    """

    kind: str
    run: str
    worker: str
    public_key: str
    at: int
    signature: str = ""

    def signed_bytes(self) -> bytes:
        """The bytes the run key signs: the kind's domain, then every field but the signature as sorted JSON."""
        fields = {k: v for k, v in asdict(self).items() if k != "signature"}
        return DOMAINS[self.kind] + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    def to_json(self) -> bytes:
        """The stored object."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, data: bytes) -> Statement:
        """Read a stored statement (untrusted bytes).

        Raises:
            IdentityError: ``identity_malformed`` (not a statement of a known kind, or a mistyped field).
        """
        try:
            obj = load_object(data, "worker key statement", max_bytes=MAX_STATEMENT_BYTES, max_depth=1)
            st = cls(kind=field_str(obj, "kind", max_len=16), run=field_str(obj, "run", max_len=256),
                     worker=field_str(obj, "worker", max_len=64), public_key=field_str(obj, "public_key"),
                     at=field_int(obj, "at", hi=2**40), signature=field_str(obj, "signature"))
        except ValueError as e:
            raise IdentityError("identity_malformed", str(e)[:200]) from None
        if st.kind not in DOMAINS or not is_hex(st.public_key, PUBLIC_HEX) or not _NAME.fullmatch(st.worker):
            raise IdentityError("identity_malformed", "not an identity or revocation of a named Ed25519 key")
        return st

    def check(self, run_id: str, run_key: str) -> None:
        """Raise :class:`IdentityError` unless this statement is of ``run_id`` and signed by ``run_key``.

        Args:
            run_id: the trainer's run.
            run_key: the run's public key (the one the trainer holds).
        """
        if self.run != run_id:
            raise IdentityError("identity_run", f"issued for run {self.run[:64]!r}, not {run_id!r}")
        problem = signature_problem(run_key, self.signature, self.signed_bytes())
        if problem is not None:
            reason = "identity_malformed" if problem[0] == "malformed_signature" else "identity_forged"
            raise IdentityError(reason, f"{self.kind} of {self.worker}: {problem[1]}")


def ed25519_required() -> Any:
    """The ``cryptography`` Ed25519 module; ``RunKeyError`` naming the extra to install when it is missing."""
    ed = ed25519()
    if ed is None:  # pragma: no cover - an install without the trainer or worker extra
        raise RunKeyError("worker keys need the 'cryptography' package: pip install 'stoa[worker]'")
    return ed


def _raw_public(private: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def record_message(record_key: str, body: bytes) -> bytes:
    """The bytes a worker signs for a record: the domain, the record's bucket key, a newline, then its body.

    The key (``stoa.layout.rollout_key``: run, version, worker id, seq) is signed too, so a signed record copied
    under another key, of another version or worker process, no longer verifies: nobody can make a worker's own
    records count against it by moving them.

    Args:
        record_key: where the record is stored, ``runs/<run>/rollouts/v<version>/<worker>-<seq>.rec``.
        body: the record's prefix, header and payload.
    """
    return RECORD_DOMAIN + record_key.encode() + b"\n" + body


@dataclass(frozen=True)
class WorkerKey:
    """A worker's private key for one run.

    Attributes:
        run: the run id.
        worker: the worker's name (its records' worker ids are ``<name>-<6 hex>``).
        private: the ``Ed25519PrivateKey``.
    """

    run: str
    worker: str
    private: Any

    @property
    def public_hex(self) -> str:
        """The public half, 64 lowercase hex digits."""
        return _raw_public(self.private).hex()

    def record_signer(self, record_key: str) -> Callable[[bytes], bytes]:
        """The ``sign`` of ``RolloutRecord.encode`` for a record stored at ``record_key``: it makes the trailer,
        this key's public half (32 bytes), then its signature of :func:`record_message` (64 bytes).

        Args:
            record_key: the record's bucket key (``stoa.layout.rollout_key``).
        """
        public = _raw_public(self.private)
        return lambda body: public + self.private.sign(record_message(record_key, body))

    @property
    def private_hex(self) -> str:
        """The private half, 64 lowercase hex digits (a secret: a key file or a join card, both 0600)."""
        from cryptography.hazmat.primitives import serialization

        return self.private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                          serialization.NoEncryption()).hex()

    def to_json(self) -> str:
        """The key file's text (the private half in hex: keep it 0600)."""
        return json.dumps({"kind": "stoa.worker_key", "run": self.run, "worker": self.worker,
                           "public_key": self.public_hex, "private_key": self.private_hex}, indent=1) + "\n"


def new_worker_key(run_id: str, worker: str) -> WorkerKey:
    """A fresh key pair for ``worker`` in ``run_id``.

    Args:
        run_id: the run.
        worker: the worker's name (checked by :func:`check_name`).
    """
    return WorkerKey(run_id, check_name(worker), ed25519_required().Ed25519PrivateKey.generate())


def worker_key_from_hex(run_id: str, worker: str, private_hex: str) -> WorkerKey:
    """The key of ``worker`` whose private half is ``private_hex`` (a key file's or a join card's; untrusted).

    Raises:
        ValueError: not 64 lowercase hex digits, or a bad worker name.
    """
    if not is_hex(private_hex, 64):
        raise ValueError("not a worker's private key (64 lowercase hex digits)")
    return WorkerKey(run_id, check_name(worker),
                     ed25519_required().Ed25519PrivateKey.from_private_bytes(bytes.fromhex(private_hex)))


def write_worker_key(path: str | os.PathLike[str], key: WorkerKey) -> None:
    """Write a key file: created mode 0600, never overwritten.

    Raises:
        FileExistsError: the file exists.
    """
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(key.to_json())


def load_worker_key(path: str | os.PathLike[str], run_id: str, name: str = "") -> WorkerKey:
    """Read a worker key file for ``run_id`` (``stoa worker-key issue --out``).

    Args:
        path: the key file.
        run_id: the run the worker joins.
        name: the worker's ``name`` setting ("" for none): the key names the worker, so another is refused.

    Raises:
        RunKeyError: unreadable, not a worker key, a key of another run or name; the message names the fix.
    """
    try:
        obj = load_object(Path(path).read_bytes(), "worker key", max_bytes=4096, max_depth=1)
        run, worker, private = (field_str(obj, "run"), field_str(obj, "worker"), field_str(obj, "private_key"))
        if obj.get("kind") != "stoa.worker_key" or not is_hex(private, 64):
            raise ValueError("not a stoa worker key")
        key = worker_key_from_hex(run, worker, private)
        if field_str(obj, "public_key") != key.public_hex:
            raise ValueError("its public key is not its private key's (a corrupted file)")
    except (OSError, ValueError) as e:
        raise RunKeyError(f"worker_key {path}: {str(e)[:200]}; ask the operator for your key file (stoa "
                          "worker-key issue NAME --out FILE)") from None
    if run != run_id:
        raise RunKeyError(f"worker_key {path} is for run {run!r}, not {run_id!r}; use this run's key file")
    if name and name != key.worker:
        raise RunKeyError(f"--name {name!r}, but worker_key {path} is {key.worker!r}'s; leave --name out (the key "
                          "names the worker)")
    return key


def sign_statement(signer: Any, kind: str, run_id: str, worker: str, public_key: str, at: int) -> Statement:
    """A statement signed by the run key.

    Args:
        signer: the run's ``stoa.weights.signing.RunSigner``.
        kind: ``identity`` or ``revocation``.
        run_id: the run.
        worker: the worker's name.
        public_key: the worker's public key (hex).
        at: unix seconds.
    """
    st = Statement(kind, run_id, check_name(worker), public_key, int(at))
    return Statement(kind, run_id, worker, public_key, int(at), signer.sign(st.signed_bytes()))
