"""Schema of the trainer's per-step provenance, ``trainer/provenance/s<step>.jsonl``: one line per trained group.

The trainer writes one create-only object per step after the step's version is published
(``stoa.trainer.provenance``): for every group the step trained on, the record it came from, the worker that
wrote it, the policy version it was sampled with and its lag, and the trainer's verdicts on it (replay of its
tool calls, the recompute check's residual, the signature). ``stoa audit`` reads them back
(``stoa.observe.audit``) as hostile input: a line that does not parse is skipped and counted, never trusted.

A line is a flat JSON object; fields a reader does not know are ignored (later trainers may add some).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from stoa.untrusted import field_float, field_int, field_str, loads_bounded

MAX_LINE_BYTES = 4096
"""Longest provenance line read (an honest one is about 200 bytes)."""
REPLAY_VERDICTS = ("ok", "unreplayed", "-")
"""``replay``: replayed and matched (multi-turn), taken as recorded (``replay = false``), or nothing to replay."""
RECOMPUTE_VERDICTS = ("ok", "rejected", "lagged")
"""``recompute``: within the limit, over it (not trained), or lag > 0 (not judged; ``residual`` is None)."""
UNSIGNED = "unsigned"
"""``signature`` of a record that carries no signature (a run without worker keys)."""


@dataclass(frozen=True)
class ProvenanceRow:
    """One trained group of one step.

    Args:
        step: the run's step that trained it (1 for the first).
        record: the record's ``v<version>/<worker>-<seq>.rec`` label (``stoa.layout.rollout_label``).
        worker: the worker it is charged to (its key's worker id).
        version: the policy version the worker sampled it with.
        lag: the trainer's version at the step minus ``version``.
        replay: one of ``REPLAY_VERDICTS``.
        tool_calls: the tool calls the trainer replayed for it.
        recompute: one of ``RECOMPUTE_VERDICTS``.
        residual: the largest sample median ``exp|recorded - recomputed| - 1`` over its action tokens (lag 0
            only; None when not judged).
        signature: ``UNSIGNED`` or the signature verdict of the record.
    """

    step: int
    record: str
    worker: str
    version: int
    lag: int
    replay: str = "-"
    tool_calls: int = 0
    recompute: str = "lagged"
    residual: float | None = None
    signature: str = UNSIGNED

    def line(self) -> str:
        """The row as one JSON line (no newline); the residual to 6 decimals, a non-finite one as None."""
        d = asdict(self)
        if d["residual"] is not None:
            d["residual"] = round(d["residual"], 6) if math.isfinite(d["residual"]) else None
        return json.dumps(d, separators=(",", ":"))


def encode_rows(rows: list[ProvenanceRow]) -> bytes:
    """A step's object: one line per row.

    Args:
        rows: the step's rows.
    """
    return "".join(r.line() + "\n" for r in rows).encode()


def parse_row(line: bytes) -> ProvenanceRow:
    """One line of a provenance object (untrusted).

    Args:
        line: the line's bytes, without its newline.

    Raises:
        ValueError: the line is not a provenance row (too long, not JSON, a field missing or out of range).
    """
    obj = loads_bounded(line, max_bytes=MAX_LINE_BYTES, max_depth=1)
    if not isinstance(obj, Mapping):
        raise ValueError("a provenance line must be a JSON object")
    residual = None if obj.get("residual") is None else field_float(obj, "residual", bound=1e12)
    return ProvenanceRow(
        step=field_int(obj, "step", lo=1), record=field_str(obj, "record", max_len=200),
        worker=field_str(obj, "worker", max_len=128), version=field_int(obj, "version"),
        lag=field_int(obj, "lag", lo=-(2**31), hi=2**31), replay=_choice(obj, "replay", REPLAY_VERDICTS),
        tool_calls=field_int(obj, "tool_calls", hi=2**31),
        recompute=_choice(obj, "recompute", RECOMPUTE_VERDICTS), residual=residual,
        signature=field_str(obj, "signature", max_len=64))


def _choice(obj: Mapping[str, Any], name: str, allowed: tuple[str, ...]) -> str:
    value = obj.get(name)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}")
    return str(value)
