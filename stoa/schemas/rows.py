"""Schema of a metrics row: one line of a metrics chunk (``metrics/<source>/<start>-<seq>.jsonl``) or file.

A row is a flat JSON object: ``time`` (unix seconds), ``step`` when the writer counts steps, and metric names
(``train/*``, ``rollout/*``, ``worker/*``, ``eval/*``) to numbers, strings, null or short lists. Rows carry no
``schema`` field, since every key of a row is a metric to trackers and ``stoa status``: every row is version 1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from stoa.schemas import BadSchemaObject, checked
from stoa.untrusted import as_object, loads_bounded

MAX_ROW_BYTES = 1 << 20
"""A metrics line longer than this is refused (a row with ``rollout/keys`` of a large batch is tens of kB)."""
MAX_ROW_DEPTH = 4
"""Deepest JSON nesting of a row accepted (rows are flat objects; ``rollout/keys`` is a list in one)."""
SKIPPED = "the line is skipped"
"""What becomes of a refused row."""


@dataclass(frozen=True)
class MetricsRow:
    """One metrics row.

    Args:
        values: the row's fields by name (``time``, ``step`` and the metrics), as readers take them.
        schema: the schema version (always 1: rows carry no version field).
    """

    values: dict[str, Any]
    schema: int = 1

    SCHEMA = 1

    @property
    def time(self) -> float | None:
        """When the row was written (None: not said or not a number)."""
        t = self.values.get("time")
        return float(t) if isinstance(t, int | float) and not isinstance(t, bool) else None

    @property
    def step(self) -> int | None:
        """The writer's step (None: not said or not an integer)."""
        s = self.values.get("step")
        return s if isinstance(s, int) and not isinstance(s, bool) else None

    def dumps(self) -> str:
        """The row's line, newline included (what writers append to a file or a chunk)."""
        return json.dumps(self.values) + "\n"

    @classmethod
    def parse(cls, line: bytes, key: str = "metrics row") -> MetricsRow:
        """Parse one untrusted line (at most 1 MiB, four levels deep, bounded numbers; NaN and Infinity refused).

        Args:
            line: the line's bytes.
            key: the chunk or file and line, for the message.

        Raises:
            BadSchemaObject: not a row (names ``key`` and why).
        """
        try:
            value = loads_bounded(line, max_bytes=MAX_ROW_BYTES, max_depth=MAX_ROW_DEPTH)
        except ValueError as e:
            raise BadSchemaObject(key, f"is not bounded JSON ({str(e)[:200]})", SKIPPED) from None
        return cls(checked(key, lambda: as_object(value, "a row"), SKIPPED))
