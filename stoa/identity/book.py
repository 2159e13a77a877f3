"""The trainer's side of worker identities: :class:`IdentityBook` reads the run's identities and revocations and
judges each record's signature; :func:`worker_keys_wanted` decides whether a run requires them."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stoa.bucket import Bucket, BucketError
from stoa.contract import RunKeyError
from stoa.identity.keys import (
    CLOCK_SKEW_S,
    MAX_STATEMENT_BYTES,
    IdentityError,
    Statement,
    WorkerKey,
    ed25519_required,
    name_of,
    record_message,
)
from stoa.layout import identities_prefix, parse_identity_key, parse_revocation_key, revocations_prefix
from stoa.rollouts.records import RecordRejected, record_signature

log = logging.getLogger(__name__)


def _verify_record(public_key: bytes, signature: bytes, message: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature

    try:
        ed25519_required().Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


class IdentityBook:
    """The trainer's view of the run's worker keys, read from the bucket at each intake.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        run_key: the run's public key, as the trainer holds it (never read from the bucket).
        clock: unix time, for the clock check.
        skew_s: how far in the future an identity may have been issued (:data:`CLOCK_SKEW_S`).
    """

    def __init__(self, bucket: Bucket, run_id: str, run_key: str, *, clock: Callable[[], float] = time.time,
                 skew_s: float = CLOCK_SKEW_S) -> None:
        self.bucket, self.run_id, self.run_key, self.clock, self.skew_s = bucket, run_id, run_key, clock, skew_s
        self.keys: dict[str, Statement] = {}
        """Valid identities by public key."""
        self.refused: dict[str, IdentityError] = {}
        """Why an identity object stored for a public key was refused."""
        self.revoked: dict[str, Statement] = {}
        """Valid revocations by public key; kept once seen."""
        self.names: dict[str, str] = {}
        """The worker name each identity object was stored under, by public key (for listings)."""
        self._read: set[str] = set()

    def refresh(self) -> None:
        """Read identities and revocations stored since the last call (a failed listing waits for the next)."""
        for prefix, read in ((identities_prefix(self.run_id), self._identity),
                             (revocations_prefix(self.run_id), self._revocation)):
            try:
                infos = [i for i in self.bucket.list(prefix) if i.key not in self._read]
            except BucketError as e:
                log.warning("listing %s failed, retrying at the next intake: %s", prefix, e)
                continue
            for info in infos:
                try:
                    data = self.bucket.get(info.key) if info.size <= MAX_STATEMENT_BYTES else b"x" * (
                        MAX_STATEMENT_BYTES + 1)
                except BucketError as e:
                    log.warning("could not read %r, retrying at the next intake: %s", info.key, e)
                    continue
                self._read.add(info.key)
                read(info.key, data)

    def _identity(self, key: str, data: bytes) -> None:
        where = parse_identity_key(self.run_id, key)
        if where is None:
            log.warning("ignored %.200r: not an identity key of run %s", key, self.run_id)
            return
        self.names.setdefault(where.public_key, where.name)
        try:
            st = Statement.parse(data)
            if (st.kind, st.worker, st.public_key) != ("identity", where.name, where.public_key):
                raise IdentityError("identity_malformed", f"stored under {key[-120:]!r}, not its own key")
            st.check(self.run_id, self.run_key)
        except IdentityError as e:
            self.refused.setdefault(where.public_key, e)
            log.warning("refused worker identity %.200r: %s", key, e)
            return
        self.keys[st.public_key] = st

    def _revocation(self, key: str, data: bytes) -> None:
        public = parse_revocation_key(self.run_id, key)
        try:
            st = Statement.parse(data)
            if public is None or (st.kind, st.public_key) != ("revocation", public):
                raise IdentityError("identity_malformed", "not a revocation stored under its key")
            st.check(self.run_id, self.run_key)
        except IdentityError as e:  # a forged revocation must not silence an honest worker
            log.warning("ignored revocation %.200r: %s", key, e)
            return
        if st.public_key not in self.revoked:
            log.info("worker key %s... of %s revoked: its records are refused from now on", st.public_key[:16],
                     st.worker)
        self.revoked[st.public_key] = st

    def check_record(self, record_key: str, worker_id: str, data: bytes) -> str:
        """The public key (hex) that signed the record ``data`` stored under ``worker_id``; else raise.

        Args:
            record_key: the record's bucket key (signed with the record).
            worker_id: the worker id of the record's key (the header must name the same, checked later).
            data: the record's bytes (untrusted).

        Raises:
            RecordRejected: one of :data:`IDENTITY_REASONS` (or a framing reason of ``record_signature``).
        """
        signed = record_signature(data)
        if signed is None:
            raise RecordRejected("unsigned", f"{worker_id[:64]}: an unsigned record, and this run requires "
                                             "worker keys (stoa worker-key issue NAME)")
        public = signed.public_key.hex()
        if public in self.revoked:
            raise RecordRejected("revoked", f"key {public[:16]}... of {self.revoked[public].worker} was revoked")
        identity = self.keys.get(public)
        if identity is None:
            refused = self.refused.get(public)
            if refused is not None:
                raise RecordRejected(refused.reason, refused.detail)
            raise RecordRejected("identity_unknown", f"key {public[:16]}... has no identity in run {self.run_id}")
        if name_of(worker_id) != identity.worker:
            raise RecordRejected("identity_worker", f"{worker_id[:64]!r} is not a process of {identity.worker!r}, "
                                                    "whose key signed it")
        if identity.at > self.clock() + self.skew_s:
            ahead = identity.at - self.clock()
            raise RecordRejected("identity_clock", f"identity of {identity.worker} issued {ahead:.0f} s in the "
                                                   "future; fix the operator's or the trainer's clock")
        if not _verify_record(signed.public_key, signed.signature, record_message(record_key, signed.body)):
            raise RecordRejected("signature", f"the signature does not verify against {identity.worker}'s key "
                                              "(changed, or stored under another key than it was signed for)")
        return public


def key_standing(book: IdentityBook, public_hex: str) -> str:
    """``valid``, ``revoked``, ``missing`` (no identity for the key) or the reason its identity is refused.

    Args:
        book: the run's identities, refreshed.
        public_hex: a worker's public key.
    """
    if public_hex in book.revoked:
        return "revoked"
    if public_hex in book.keys:
        return "valid"
    refused = book.refused.get(public_hex)
    return refused.reason if refused is not None else "missing"


def worker_keys_wanted(setting: str, bucket_url: str, run_id: str, run_key: str,
                       echo: Callable[[str], Any] = print, *, bucket: Bucket | None = None,
                       latch: Path | None = None) -> bool:
    """Whether the trainer requires signed records, said in one line naming the setting and how to change it.

    ``required``: yes (a run without a run key refuses). ``off``: no (a private fleet). ``auto`` (the default):
    yes in a run with a run key that is in an object store (``s3://``, ``r2://``), or that holds a worker
    identity or revocation its run key signed, or whose trainer required them before (``latch``); else no (the
    local quickstart). Once ``auto`` requires them it writes ``latch``, a file beside the run's private key and
    never in the bucket, so deleting the bucket's identities cannot turn them off at a restart.

    Args:
        setting: the trainer's ``worker_keys``.
        bucket_url: the run's bucket.
        run_id: the run.
        run_key: the run's public key ("" for a run without one: identities need it).
        echo: where the one-line note goes.
        bucket: the run's bucket, to look for identities (None: do not look).
        latch: the latch file (None: none).

    Raises:
        RunKeyError: ``required`` in a run without a run key.
    """
    if setting == "required" or (setting == "auto" and run_key):
        if not run_key:
            raise RunKeyError(f"worker_keys = required: run {run_id!r} has no run key to vouch for workers; create "
                              "the run with sign_weights = true, or set worker_keys = off")
        why = "worker_keys = required" if setting == "required" else _auto_reason(bucket_url, run_id, run_key,
                                                                                 bucket, latch)
        if why:
            if setting == "auto" and latch is not None:
                _write_latch(latch, run_id)
            echo(f"[trainer] run {run_id!r}: records must be signed by a worker key ({why}; stoa join-card issues "
                 "one per card, stoa worker-key issue NAME one by hand; worker_keys = off turns this off for a "
                 "private fleet)")
            return True
    why = ("worker_keys = off" if setting == "off" else "worker_keys = auto, a run without a run key"
           if not run_key else "worker_keys = auto, a local directory whose run holds no worker identity")
    echo(f"[trainer] run {run_id!r}: worker keys off ({why}): anyone who can write the bucket can submit records "
         "under any worker id; worker_keys = required turns them on")
    return False


def _auto_reason(bucket_url: str, run_id: str, run_key: str, bucket: Bucket | None, latch: Path | None) -> str:
    """Why ``auto`` requires worker keys in a run with a run key ("" when it does not)."""
    if "://" in bucket_url and not bucket_url.startswith("file://"):
        return "worker_keys = auto, an object store run with a run key"
    if latch is not None and latch.is_file():
        return f"worker_keys = auto, latched on by an earlier start ({latch})"
    if bucket is not None:
        book = IdentityBook(bucket, run_id, run_key)
        book.refresh()
        if book.keys or book.revoked:
            return "worker_keys = auto, the run holds worker identities"
    return ""


def _write_latch(latch: Path, run_id: str) -> None:
    """Write the latch file (0600) unless it exists; a failure is logged, not fatal."""
    if latch.is_file():
        return
    try:
        latch.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(latch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(f"run {run_id!r} requires worker keys since {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}"
                    " (worker_keys = auto); deleting this file lets auto decide afresh\n")
    except FileExistsError:
        return
    except OSError as e:
        log.warning("could not write the worker-key latch %s: %s", latch, e)


def worker_keys_latch(run_key_path: Path) -> Path:
    """The latch file of a run whose private key is ``run_key_path``: beside it, never in the bucket."""
    return run_key_path.with_name(run_key_path.name + ".worker-keys")


def note_worker_key(bucket: Bucket, run_id: str, run_key: str, key: WorkerKey | None,
                    echo: Callable[[str], Any]) -> None:
    """The worker's line on how its records will be judged; a revoked key refuses to start.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        run_key: the run's public key, as the worker pinned it ("" for a run without one).
        key: the worker's key (None: unsigned records).
        echo: where the line goes.

    Raises:
        RunKeyError: the key is revoked in the run.
    """
    if key is None:
        if run_key:
            echo("[worker] no worker_key: records go unsigned, and a run with worker keys (the default in s3:// "
                 "and r2:// buckets) refuses them; ask the operator for a join card (it carries one) or a key file "
                 "(stoa worker-key issue NAME)")
        return
    book = IdentityBook(bucket, run_id, run_key)
    book.refresh()
    standing = key_standing(book, key.public_hex) if run_key else "unchecked (the run has no run key)"
    if standing == "revoked":
        raise RunKeyError(f"worker key {key.public_hex[:16]}... of {key.worker!r} is revoked in run {run_id!r}; "
                          "ask the operator for a new one (stoa worker-key issue NAME)")
    echo(f"[worker] signing records as {key.worker!r} (key {key.public_hex[:16]}..., identity {standing})")
