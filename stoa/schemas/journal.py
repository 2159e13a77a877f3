"""Schema of the trainer's journal, ``trainer/journal.json``: what a restarted trainer resumes from.

The trainer overwrites it once per step (``stoa.trainer.checkpoint.write_journal``) with the version and step it
is about to publish, the pool's record uses and the quarantine's per-worker counts. The pool's and the
quarantine's rows are stored as JSON arrays (``[version, count, key]`` and ``[records, rejected, tokens, over,
lag0_records, reason]``, the format every earlier trainer wrote and reads); :class:`PoolUse` and
:class:`QuarantineRow` name their fields, so no reader indexes a row by position.

A journal's top level is checked strictly (:meth:`Journal.parse` raises
:class:`~stoa.schemas.BadSchemaObject`); a malformed row inside it is dropped and counted (``dropped``): the
trainer rebuilds what it loses, at worst letting a record be used again or a worker be judged afresh.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stoa.schemas import SCHEMA_FIELD, checked, load, schema_version, versioned
from stoa.untrusted import MAX_INT, as_object, check_int

MAX_JOURNAL_BYTES = 64 << 20
"""Largest journal read (a pool of a million uses fits)."""
MAX_JOURNAL_DEPTH = 6
"""Deepest nesting a journal may have (its rows sit four levels down)."""
QUARANTINE_REASONS = ("", "reject_rate", "disagreement", "sequential")
"""Why a worker is quarantined (empty: it is not)."""
QUARANTINE_STATE = 1
"""Version of the quarantine's state inside the journal (its ``v``)."""


def _count(x: Any) -> bool:
    """Whether ``x`` is a finite, non-negative number from JSON (not a bool)."""
    return not isinstance(x, bool) and isinstance(x, int | float) and math.isfinite(x) and x >= 0


@dataclass(frozen=True)
class PoolUse:
    """One record's uses in the pool's window (stored as ``[version, count, key]``).

    Args:
        version: the record's policy version.
        count: how many times a step used it.
        key: the bucket key it was taken under.
    """

    version: int
    count: int
    key: str

    def to_json(self) -> list[Any]:
        """The stored row."""
        return [self.version, self.count, self.key]

    @classmethod
    def parse(cls, row: Any) -> PoolUse | None:
        """The row as a use; None when it is not ``[int, int, str]`` (a bool is not an int).

        Args:
            row: the parsed JSON value.
        """
        if not (isinstance(row, list) and len(row) == 3 and type(row[0]) is int and type(row[1]) is int
                and isinstance(row[2], str)):
            return None
        return cls(row[0], row[1], row[2])


@dataclass(frozen=True)
class QuarantineRow:
    """One worker's counts in the quarantine (stored as ``[records, rejected, tokens, over, lag0_records,
    reason, cusum]``; a row of six, written before the sequential test, reads with ``cusum`` 0).

    Args:
        records: records of it read (halved as they pass a window).
        rejected: of those, rejected.
        tokens: lag-0 tokens compared.
        over: of those, over the disagreement threshold.
        lag0_records: lag-0 records compared.
        reason: why it is quarantined (``reject_rate``, ``disagreement``, ``sequential``; empty: it is not).
        cusum: the sequential test's sum (``stoa.trainer.sequential``).
    """

    records: float
    rejected: float
    tokens: float
    over: float
    lag0_records: float
    reason: str
    cusum: float = 0.0

    def to_json(self) -> list[Any]:
        """The stored row."""
        row = [self.records, self.rejected, self.tokens, self.over, self.lag0_records, self.reason]
        return [*row, self.cusum] if self.cusum else row  # six when 0, as before: an older trainer reads it

    @classmethod
    def parse(cls, row: Any) -> QuarantineRow | None:
        """The row as counts; None unless it holds five finite non-negative numbers, a known reason and (optional)
        a finite non-negative sum.

        Args:
            row: the parsed JSON value.
        """
        if not (isinstance(row, list) and len(row) in (6, 7) and row[5] in QUARANTINE_REASONS
                and all(_count(x) for x in row[:5] + row[6:])):
            return None
        return cls(*row)  # the numbers as stored (an integer count stays one), so a rewrite keeps the bytes


@dataclass(frozen=True)
class Journal:
    """What ``trainer/journal.json`` holds.

    Args:
        version: the version the step publishes (None: not said).
        step: the run's steps after it (None: not said; the checkpoint's step is used).
        uses: the pool's record uses by content id.
        replays: the pool's accepted records by replay id (their content id without the version: ``[version, 0,
            key]``), so a restarted trainer still refuses their samples relabelled to another version.
        quarantine: the quarantine's rows by worker id.
        threshold: the disagreement threshold the quarantine's token counts were made against (None: unknown).
        sequential: the sequential test's ``[drift, limit, cap]`` its sums were made against (None: unknown).
        dropped: rows refused on reading (not written).
        schema: the schema version (absent in older journals: 1).
    """

    version: int | None = None
    step: int | None = None
    uses: Mapping[str, PoolUse] = field(default_factory=dict)
    quarantine: Mapping[str, QuarantineRow] = field(default_factory=dict)
    threshold: float | None = None
    dropped: int = 0
    schema: int = 1
    sequential: tuple[float, float, float] | None = None
    replays: Mapping[str, PoolUse] = field(default_factory=dict)

    SCHEMA = 1

    def to_json(self) -> bytes:
        """Serialize for the bucket: the trainer's state (:meth:`state`), the pool and the quarantine always
        present, as trainers always wrote them."""
        doc = {SCHEMA_FIELD: self.schema, "pool": self.pool_state(), "quarantine": self.quarantine_state(),
               **self.state()}
        return json.dumps(versioned(doc), sort_keys=True).encode()

    def state(self) -> dict[str, Any]:
        """The trainer's state: ``version`` and ``step`` (when said), ``pool`` and ``quarantine`` (what
        ``Pool.restore`` and ``Quarantine.restore`` take; left out when empty); :meth:`from_state` reads it back."""
        doc: dict[str, Any] = {k: v for k, v in (("version", self.version), ("step", self.step)) if v is not None}
        if self.uses or self.replays:
            doc["pool"] = self.pool_state()
        if self.quarantine or self.threshold is not None:
            doc["quarantine"] = self.quarantine_state()
        return doc

    def pool_state(self) -> dict[str, Any]:
        """The pool's state (``stoa.trainer.pool.Pool.restore``)."""
        out: dict[str, Any] = {"records": {cid: use.to_json() for cid, use in self.uses.items()}}
        if self.replays:
            out["replays"] = {rid: use.to_json() for rid, use in self.replays.items()}
        return out

    def quarantine_state(self) -> dict[str, Any]:
        """The quarantine's state (``stoa.trainer.quarantine.Quarantine.restore``)."""
        out: dict[str, Any] = {"v": QUARANTINE_STATE, "workers": {k: r.to_json() for k, r in self.quarantine.items()}}
        if self.threshold is not None:
            out["threshold"] = self.threshold
        if self.sequential is not None:
            out["sequential"] = list(self.sequential)
        return out

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Journal:
        """The journal of a trainer's state: ``version``, ``step``, ``pool`` (``Pool.state()``) and ``quarantine``
        (``Quarantine.state()``); the rows go through the same checks as on reading.

        Args:
            state: the trainer's state.
        """
        return cls._fields(dict(state), 1)

    @classmethod
    def parse(cls, data: bytes, key: str = "journal.json") -> Journal:
        """Parse untrusted bytes (at most 64 MiB, six levels deep; ``step`` and ``version`` integers, ``pool``
        and ``quarantine`` objects); a malformed row is dropped and counted.

        Args:
            data: the stored bytes.
            key: the object's key, for the message.

        Raises:
            BadSchemaObject: not a journal (names the key and the field).
        """
        d = load(data, key, max_bytes=MAX_JOURNAL_BYTES, max_depth=MAX_JOURNAL_DEPTH)
        schema = schema_version(d, key, cls.SCHEMA)
        return checked(key, lambda: cls._fields(d, schema))

    @classmethod
    def _fields(cls, d: dict[str, Any], schema: int) -> Journal:
        version, step = (check_int(d[n], n, hi=MAX_INT) if n in d else None for n in ("version", "step"))
        pool, quarantine = as_object(d.get("pool", {}), "pool"), as_object(d.get("quarantine", {}), "quarantine")
        records = pool.get("records", {})
        workers = quarantine.get("workers", {})
        uses = {str(k): u for k, v in _items(records) if (u := PoolUse.parse(v)) is not None}
        replays = {str(k): u for k, v in _items(pool.get("replays")) if (u := PoolUse.parse(v)) is not None}
        rows = {k: r for k, v in _items(workers) if (r := QuarantineRow.parse(v)) is not None}
        threshold = quarantine.get("threshold")
        threshold = None if isinstance(threshold, bool) or not isinstance(threshold, int | float) else float(threshold)
        dropped = (len(_items(records)) - len(uses) + len(_items(pool.get("replays"))) - len(replays)
                   + len(_items(workers)) - len(rows))
        seq = quarantine.get("sequential")
        sequential = (tuple(float(x) for x in seq) if isinstance(seq, list) and len(seq) == 3
                      and all(_count(x) for x in seq) else None)
        return cls(version, step, uses, rows, threshold, dropped, schema, sequential,  # type: ignore[arg-type]
                   replays)


def _items(value: Any) -> list[tuple[str, Any]]:
    """The entries of a JSON object (nothing when it is not one)."""
    return list(value.items()) if isinstance(value, dict) else []
