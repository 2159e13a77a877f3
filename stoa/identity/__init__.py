"""Worker identities: per-worker Ed25519 keys that the run key vouches for, and the records they sign.

The operator's run key (``stoa.weights.signing``: private half in a local file, public half the contract's
``run_key``) signs each worker's *identity* (run, worker name, the worker's public key, issued-at), stored at
``stoa.layout.identity_key``; ``stoa worker-key revoke`` stores a signed *revocation* of a key at
``stoa.layout.revocation_key``. The worker keeps its private key (a 0600 file, :func:`write_worker_key`) and
signs every record it uploads (record schema version 3: its public key and signature ride in the record's
trailer, ``stoa.rollouts.records.record_signature``). The trainer's :class:`IdentityBook` reads identities and
revocations at every intake, trusts only statements its own run key signed, and refuses a record whose
signature, identity or revocation says no, with one of :data:`IDENTITY_REASONS`. Those rejections are never
held against the worker id a record names: without that worker's key nobody can frame it.

Trust: the trainer checks statements against the run key it holds, never a key read from the bucket. A
revocation once seen stays in force for the trainer's life even if the object is deleted. The cryptography is
the ``cryptography`` package's Ed25519.
"""

from stoa.identity.book import IdentityBook, key_standing, note_worker_key, worker_keys_latch, worker_keys_wanted
from stoa.identity.issue import issue_key, revoke_keys
from stoa.identity.keys import (
    CLOCK_SKEW_S,
    IDENTITY_REASONS,
    IdentityError,
    Statement,
    WorkerKey,
    check_name,
    load_worker_key,
    name_of,
    new_worker_key,
    record_message,
    sign_statement,
    worker_key_from_hex,
    write_worker_key,
)

__all__ = ["CLOCK_SKEW_S", "IDENTITY_REASONS", "IdentityBook", "IdentityError", "Statement",
           "key_standing", "note_worker_key",
           "WorkerKey", "check_name", "issue_key", "load_worker_key", "name_of", "new_worker_key", "record_message",
           "revoke_keys", "sign_statement", "worker_key_from_hex", "worker_keys_latch", "worker_keys_wanted",
           "write_worker_key"]
