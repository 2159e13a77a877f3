"""The operator's side of worker identities: issue a worker's key (its identity signed by the run key) and
revoke a worker's keys (``stoa worker-key``)."""

from __future__ import annotations

import time
from typing import Any

from stoa.bucket import Bucket
from stoa.identity.book import IdentityBook
from stoa.identity.keys import Statement, WorkerKey, new_worker_key, sign_statement
from stoa.layout import identity_key, revocation_key


def issue_key(bucket: Bucket, run_id: str, worker: str, signer: Any, now: float | None = None) -> tuple[
        WorkerKey, Statement]:
    """Make a key pair for ``worker``, store its identity signed by the run key (create-only) and return both.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        worker: the worker's name.
        signer: the run's ``RunSigner``.
        now: unix seconds (default: now).
    """
    key = new_worker_key(run_id, worker)
    st = sign_statement(signer, "identity", run_id, worker, key.public_hex, int(time.time() if now is None else now))
    bucket.put_create(identity_key(run_id, worker, key.public_hex), st.to_json())
    return key, st


def revoke_keys(bucket: Bucket, book: IdentityBook, worker: str, signer: Any, now: float | None = None) -> list[str]:
    """Store a signed revocation of every valid key of ``worker`` not yet revoked; the public keys revoked.

    Args:
        bucket: the run's bucket.
        book: the run's identities, refreshed.
        worker: the worker's name.
        signer: the run's ``RunSigner``.
        now: unix seconds (default: now).
    """
    at = int(time.time() if now is None else now)
    done = []
    for public, st in book.keys.items():
        if st.worker == worker and public not in book.revoked:
            rev = sign_statement(signer, "revocation", book.run_id, worker, public, at)
            bucket.put_create(revocation_key(book.run_id, public), rev.to_json())
            done.append(public)
    return done
