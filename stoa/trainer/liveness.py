"""The trainer's count of live workers, published in the run status so that workers share the want.

A worker is live for ``LIVE_S`` seconds (the trainer's monotonic clock) after the trainer accepted a record of
it or listed a presence object of it (``runs/<run>/workers/<id>-<seq>``, see :mod:`stoa.lifecycle`). Records
cost nothing more: their worker ids come from the pool's entries, which are validated. Presence objects cost
one LIST per ``list_every_s``, or per call while nobody is counted or the last listing found some (workers are
joining: a fleet that starts together is counted within a poll of its last arrival, not a heartbeat later;
planted objects can make that every poll, never more), and one DELETE per object listed (free on R2 and S3):
the prefix holds only what arrived since the last listing. A listing reads at most ``MAX_LISTED`` keys; a key
that does not parse is deleted if the bucket accepts the name, else skipped, and counted in ``rejected``.

Presence objects are untrusted: anyone who can write the bucket can plant ids that never deliver a record. Such
ids (presence only) count for at most ``max_joining`` workers, so planted ids can lower honest workers' shares
(a slower fill, waste) but never to zero; ids on accepted records are not capped (each took a valid record).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from stoa.bucket import Bucket, BucketError
from stoa.layout import parse_presence_key, presence_prefix
from stoa.lifecycle import LIVE_S

MAX_LISTED = 1000
"""Most presence keys one listing reads (one LIST page)."""
JOINING_LIST_FRACTION = 0.25
"""While workers are joining (the last listing found some), list again after this fraction of ``list_every_s``."""
MAX_JOINING = 64
"""Most workers counted on presence objects alone (no accepted record yet)."""


class _Entry(Protocol):
    """What the count reads of a pool entry: its content id and record (with the worker id)."""

    content_id: str
    record: Any


class LiveWorkers:
    """Counts the workers seen on accepted records or presence objects in the last ``live_s`` seconds.

    Args:
        bucket: the run's bucket.
        run_id: the run id.
        list_every_s: list the presence prefix at most this often once some worker is counted.
        live_s: seconds a worker stays counted after it was last seen.
        max_joining: most workers counted on presence objects alone.
        clock: monotonic clock (tests pass a fake one).
    """

    def __init__(self, bucket: Bucket, run_id: str, list_every_s: float, *, live_s: float = LIVE_S,
                 max_joining: int = MAX_JOINING, clock: Callable[[], float] = time.monotonic) -> None:
        self.bucket, self.run_id, self.list_every_s = bucket, run_id, list_every_s
        self.live_s, self.max_joining, self._clock = live_s, max_joining, clock
        self._delivered: dict[str, float] = {}
        self._announced: dict[str, float] = {}
        self._entries: set[str] = set()
        self._listed_at: float | None = None
        self._after: str | None = None
        self._found = False
        """Whether the last listing found presence objects (workers are joining: list again at the next call)."""
        """Where the next listing starts: the last key of a listing cut at ``MAX_LISTED`` (keys that stay)."""
        self.count = 0
        """The live workers after the last :meth:`update`."""
        self.listings = 0
        """Presence listings made."""
        self.rejected = 0
        """Listed keys under the presence prefix that are not presence keys."""

    def update(self, entries: Iterable[_Entry]) -> int:
        """Note the workers of pool entries not seen before, list presence objects if due, forget workers not
        seen for ``live_s``; return the live count.

        Args:
            entries: the pool's entries now (every accepted record passes here before it is taken).
        """
        now = self._clock()
        current = set()
        for e in entries:
            current.add(e.content_id)
            if e.content_id not in self._entries:
                self._delivered[e.record.worker_id] = now
        self._entries = current
        since = None if self._listed_at is None else now - self._listed_at
        if (since is None or self.count == 0 or since >= self.list_every_s
                or (self._found and since >= JOINING_LIST_FRACTION * self.list_every_s)):
            self._listed_at = now
            self._list(now)
        for seen in (self._delivered, self._announced):
            for wid in [w for w, t in seen.items() if now - t > self.live_s]:
                del seen[wid]
        joining = sum(1 for w in self._announced if w not in self._delivered)
        self.count = len(self._delivered) + min(joining, self.max_joining)
        return self.count

    def _list(self, now: float) -> None:
        """Read up to ``MAX_LISTED`` presence keys, note their workers, delete them (bucket errors: next time).
        A listing cut at ``MAX_LISTED`` is continued by the next one, so keys that cannot be deleted never hide
        the ones after them."""
        self.listings += 1
        keys: list[str] = []
        try:
            for info in self.bucket.list(presence_prefix(self.run_id), start_after=self._after):
                keys.append(info.key)
                if len(keys) >= MAX_LISTED:
                    break
        except BucketError:
            return
        self._after = keys[-1] if len(keys) >= MAX_LISTED else None
        self._found = bool(keys)
        for key in keys:
            wid = parse_presence_key(self.run_id, key)
            if wid is None:
                self.rejected += 1
            else:
                self._announced[wid] = now
            try:
                self.bucket.delete(key)
            except (BucketError, ValueError):  # a name the bucket refuses stays, skipped at every listing
                pass
