"""One trainer per run: a lease object in the bucket, renewed by compare-and-swap, with fencing.

``runs/<run>/trainer/lease.json`` names the trainer that holds the run (holder id, host, pid, start,
heartbeat time, epoch). A trainer creates it by CAS (expected etag None), or takes it over by CAS from
a holder that released it, that died on this host (its pid is gone), or, with ``--take-over``, whose
heartbeat is older than ``lease_ttl_seconds``. Each take-over bumps the epoch.

Fencing: the holder renews the lease by CAS with the etag it last wrote right before each group of writes
(journal, publish, checkpoint), and every single write goes through :class:`FencedBucket`, which first
checks (no request) that the last renewal began less than a quarter TTL ago and otherwise renews by CAS. A
trainer that was paused (SIGSTOP) anywhere, even between encoding a patch and writing it, while another
took over, finds the etag moved, raises :class:`LeaseLost` and writes nothing. The only window left is
between that check and the write call itself (no work in between), and a take-over needs the heartbeat to
be a whole TTL old. A daemon thread renews the heartbeat every few seconds, so a
trainer busy with a long step or waiting for records stays alive. Heartbeat ages compare the holder's
wall clock with the reader's: keep the TTL well above the clock skew between machines.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace

from stoa.bucket import Bucket, ObjectInfo, ObjectNotFound, PreconditionFailed
from stoa.layout import lease_key
from stoa.schemas.control import LeaseRecord

DEFAULT_TTL_S = 120.0
"""A lease whose heartbeat is older than this may be taken over with ``--take-over``."""


class LeaseHeld(RuntimeError):
    """Another live trainer holds the run; the message names it, its host, pid, heartbeat age and the fix."""


class LeaseLost(RuntimeError):
    """This trainer's lease was taken over (or released) by another: it must stop without writing."""


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host.

    Args:
        pid: process id.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


class Lease:
    """The lease of one run as seen by one trainer process.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        ttl_s: heartbeat age after which ``take_over`` may take the lease.
        model: the ``--model`` this trainer was started with (recorded for restarts).
        clock: wall clock (tests pass a fake one).
        echo: where notes go (a take-over).
    """

    def __init__(self, bucket: Bucket, run_id: str, ttl_s: float = DEFAULT_TTL_S, *, model: str = "",
                 clock=time.time, echo=print) -> None:
        self.bucket, self.run_id, self.ttl_s, self.clock, self.echo = bucket, run_id, ttl_s, clock, echo
        self.key = lease_key(run_id)
        now = clock()
        self.mine = LeaseRecord(uuid.uuid4().hex[:12], socket.gethostname(), os.getpid(), now, now, 0, model)
        self.etag: str | None = None
        self.lost = False
        self._renewed_at = float("-inf")  # monotonic time the last successful renewal (or acquire) began
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> tuple[LeaseRecord | None, str | None]:
        """The stored lease and its etag; ``(None, None)`` when there is none (``(None, etag)``: unreadable)."""
        try:
            data, etag = self.bucket.get_with_etag(self.key)
        except ObjectNotFound:
            return None, None
        try:
            return LeaseRecord.parse(data, self.key), etag
        except ValueError:  # refused: treated like a stale lease (--take-over replaces it)
            return None, etag

    def acquire(self, take_over: bool = False) -> LeaseRecord | None:
        """Take the lease or raise :class:`LeaseHeld`; returns the previous holder's record (None if none).

        Args:
            take_over: take a lease whose heartbeat is older than the TTL (a live-looking one is refused).
        """
        while True:
            prev, etag = self.read()
            if etag is not None:
                self._check_takeable(prev, take_over)
            now, began = self.clock(), time.monotonic()
            epoch = (prev.epoch if prev else 0) + 1
            rec = replace(self.mine, started=now, heartbeat=now, epoch=epoch)
            try:
                self.etag = self.bucket.cas(self.key, rec.to_json(), etag)
            except PreconditionFailed:
                continue  # someone else moved it between our read and CAS: judge the new one
            self.mine, self._renewed_at = rec, began
            if prev is not None and not prev.released:
                self.echo(f"[trainer] took over run {self.run_id!r} from trainer {prev.holder} on {prev.host} "
                          f"(pid {prev.pid}, heartbeat {now - prev.heartbeat:.0f}s old); epoch {epoch}")
            return prev

    def _check_takeable(self, prev: LeaseRecord | None, take_over: bool) -> None:
        if prev is None:
            if take_over:
                return
            raise LeaseHeld(f"run {self.run_id!r} has an unreadable lease at {self.key}; start with --take-over "
                            "if no other trainer runs")
        if prev.released or (prev.host == self.mine.host and not pid_alive(prev.pid)):
            return  # stopped cleanly, or died on this host
        age = self.clock() - prev.heartbeat
        who = f"trainer {prev.holder} on host {prev.host} (pid {prev.pid})"
        if take_over and age > self.ttl_s:
            return
        if take_over:
            raise LeaseHeld(f"run {self.run_id!r} is held by {who}, heartbeat {age:.0f}s ago: --take-over needs "
                            f"it older than lease_ttl_seconds ({self.ttl_s:.0f}s); stop that trainer or wait")
        raise LeaseHeld(f"run {self.run_id!r} is held by {who}, heartbeat {age:.0f}s ago; stop it, or once the "
                        f"heartbeat is older than lease_ttl_seconds ({self.ttl_s:.0f}s) start with --take-over")

    def renew(self) -> None:
        """Renew the heartbeat by CAS with the last etag; raise :class:`LeaseLost` if another trainer moved it.

        Call it right before every group of writes: it is the fence.
        """
        with self._lock:
            if self.lost:
                raise LeaseLost(self._lost_message())
            if self.etag is None:
                raise LeaseLost(f"run {self.run_id!r}: this trainer does not hold the lease")
            rec, began = replace(self.mine, heartbeat=self.clock()), time.monotonic()
            try:
                self.etag = self.bucket.cas(self.key, rec.to_json(), self.etag)
            except PreconditionFailed:
                if not self._still_mine():
                    self.lost = True
                    raise LeaseLost(self._lost_message()) from None
                self.etag = self.bucket.cas(self.key, rec.to_json(), self.etag)
            self.mine, self._renewed_at = rec, began

    def guard(self) -> None:
        """Before one write: fine without a request while the last renewal began under a quarter TTL ago
        (nobody can have taken over since), else :meth:`renew`; :class:`LeaseLost` if the lease is gone."""
        if self.lost or time.monotonic() - self._renewed_at > self.ttl_s / 4:
            self.renew()

    def _still_mine(self) -> bool:
        """After a lost CAS: our own earlier write may have landed though its answer was lost (a retry)."""
        stored, etag = self.read()
        if stored is not None and stored.holder == self.mine.holder and stored.epoch == self.mine.epoch \
                and not stored.released:
            self.etag = etag
            return True
        return False

    def _lost_message(self) -> str:
        stored, _ = self.read()
        by = f" by trainer {stored.holder} on {stored.host} (pid {stored.pid})" if stored else ""
        return (f"run {self.run_id!r}: this trainer lost its lease{by}; it stops without writing anything "
                "(the other trainer owns the run now)")

    def start_heartbeat(self, every_s: float | None = None) -> None:
        """Renew from a daemon thread every ``every_s`` (default: a quarter of the TTL, at most 5 s).

        Args:
            every_s: seconds between renewals.
        """
        period = every_s if every_s is not None else min(5.0, self.ttl_s / 4)

        def beat() -> None:
            while not self._stop.wait(period):
                try:
                    self.renew()
                except LeaseLost:
                    return
                except Exception as e:  # an outage: the next beat retries; the fence is the step's renew
                    self.echo(f"[trainer] lease heartbeat failed, retrying: {e}")

        self._thread = threading.Thread(target=beat, name="stoa-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat and mark the lease released (CAS), so the next trainer starts at once.

        Does nothing when the lease was lost (the new holder's record stays).
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            if self.lost or self.etag is None:
                return
            rec = replace(self.mine, heartbeat=self.clock(), released=True)
            try:
                self.bucket.cas(self.key, rec.to_json(), self.etag)
            except PreconditionFailed:
                self.lost = True
                return
            self.etag = None


class FencedBucket:
    """A bucket whose every write (put, create, CAS, delete, upload) first calls :meth:`Lease.guard`.

    Reads go straight through. The trainer hands this to everything that writes (journal, publisher,
    checkpoint, status, metrics), so a trainer that lost its lease cannot write even one more object.

    Args:
        inner: the bucket.
        lease: the lease held on it.
    """

    def __init__(self, inner: Bucket, lease: Lease) -> None:
        self._inner, self._lease = inner, lease
        self.url = inner.url

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def get(self, key: str) -> bytes:
        """Read (no guard)."""
        return self._inner.get(key)

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        """Read with the etag (no guard)."""
        return self._inner.get_with_etag(key)

    def get_if_changed(self, key: str, etag: str | None) -> tuple[bytes, str] | None:
        """Conditional read (no guard)."""
        return self._inner.get_if_changed(key, etag)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Ranged read (no guard)."""
        return self._inner.get_range(key, start, end)

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """Listing (no guard)."""
        return self._inner.list(prefix, start_after)

    def exists(self, key: str) -> bool:
        """Existence check (no guard)."""
        return self._inner.exists(key)

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Download (no guard)."""
        self._inner.get_file(key, path)

    def __repr__(self) -> str:
        return f"FencedBucket({self._inner!r})"

    def put_create(self, key: str, data: bytes) -> None:
        """Create-only put, after the lease guard."""
        self._lease.guard()
        self._inner.put_create(key, data)

    def put(self, key: str, data: bytes) -> None:
        """Overwrite, after the lease guard."""
        self._lease.guard()
        self._inner.put(key, data)

    def cas(self, key: str, data: bytes, expected_etag: str | None) -> str:
        """Compare-and-swap, after the lease guard."""
        self._lease.guard()
        return self._inner.cas(key, data, expected_etag)

    def delete(self, key: str) -> None:
        """Delete, after the lease guard."""
        self._lease.guard()
        self._inner.delete(key)

    def delete_prefix(self, prefix: str) -> int:
        """Delete a prefix, after the lease guard."""
        self._lease.guard()
        return self._inner.delete_prefix(prefix)

    def put_file(self, key: str, path: str | os.PathLike[str], *, create_only: bool = True) -> None:
        """Upload a file, after the lease guard."""
        self._lease.guard()
        self._inner.put_file(key, path, create_only=create_only)
