"""``stoa audit``'s logic: read a run's per-step provenance from its bucket (``stoa.schemas.provenance``) and show,
for every group the trainer trained on, the worker, its version and lag, the trainer's verdicts and the step.

Everything read is hostile: only keys of the exact provenance pattern are read, objects over
``MAX_PROVENANCE_BYTES`` are never fetched, and a line that does not parse (or names another step than its
object) is skipped and counted; nothing read raises past ``read_audit`` but a bucket error.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from stoa.bucket import Bucket, ObjectNotFound
from stoa.contract import RunNotFound
from stoa.layout import parse_provenance_key, provenance_prefix, run_prefix
from stoa.observe.runs import check_run_id, printable
from stoa.schemas.provenance import ProvenanceRow, parse_row

MAX_PROVENANCE_BYTES = 4 << 20
"""Largest provenance object read (a step of 10,000 groups is about 2 MB)."""


@dataclass(frozen=True)
class Audit:
    """What ``read_audit`` found.

    Args:
        run: the run.
        rows: the rows, by step then in each step's order.
        objects: provenance objects read.
        skipped_lines: lines that did not parse or named another step than their object.
        skipped_objects: objects not read (oversize, foreign name under the prefix, vanished, not UTF-8 lines).
    """

    run: str
    rows: tuple[ProvenanceRow, ...]
    objects: int
    skipped_lines: int = 0
    skipped_objects: int = 0


def read_audit(bucket: Bucket, run_id: str, step: int | None = None) -> Audit:
    """Read a run's provenance (every step, or one).

    Args:
        bucket: the bucket.
        run_id: the run.
        step: only this step (None: the whole run).

    Raises:
        ConfigError: a RUN that is not a run id.
        RunNotFound: nothing is stored under the run's prefix.
        BucketError: the bucket cannot be listed or read.
    """
    check_run_id(run_id)
    listed = list(bucket.list(provenance_prefix(run_id)))
    if not listed and next(iter(bucket.list(run_prefix(run_id) + "/")), None) is None:
        raise RunNotFound(f"no run {run_id!r} in bucket {bucket.url} (nothing under its prefix); stoa runs "
                          f"--bucket {bucket.url} lists the runs")
    rows: list[ProvenanceRow] = []
    objects = bad_lines = bad_objects = 0
    for info in listed:
        at = parse_provenance_key(run_id, info.key)
        if at is None or info.size > MAX_PROVENANCE_BYTES:
            bad_objects += 1
            continue
        if step is not None and at != step:
            continue
        try:
            data = bucket.get_range(info.key, 0, MAX_PROVENANCE_BYTES + 1)  # never more held, whatever is there
        except ObjectNotFound:  # deleted between the listing and the read
            bad_objects += 1
            continue
        if len(data) > MAX_PROVENANCE_BYTES:  # rewritten bigger since the listing
            bad_objects += 1
            continue
        objects += 1
        good, bad = _rows(data, at)
        rows += good
        bad_lines += bad
    return Audit(run_id, tuple(rows), objects, bad_lines, bad_objects)


def _rows(data: bytes, step: int) -> tuple[list[ProvenanceRow], int]:
    """The rows of one object of ``step`` and how many of its non-empty lines were skipped."""
    good, bad = [], 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            row = parse_row(line)
        except ValueError:
            bad += 1
            continue
        if row.step != step:
            bad += 1
            continue
        good.append(row)
    return good, bad


COLUMNS = ("step", "worker", "version", "lag", "replay", "recompute", "residual", "signature", "record")
"""The table's columns, in order."""


def _cells(r: ProvenanceRow) -> tuple[str, ...]:
    residual = "-" if r.residual is None else f"{r.residual:.3f}"
    replay = f"{r.replay} ({r.tool_calls} calls)" if r.replay == "ok" else r.replay
    return (str(r.step), printable(r.worker), f"v{r.version}", str(r.lag), replay, r.recompute, residual,
            printable(r.signature), printable(r.record))


def render(audit: Audit) -> str:
    """The table ``stoa audit`` prints: a row per trained group, then one line per worker and the counts."""
    cells = [COLUMNS] + [_cells(r) for r in audit.rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines += ["", *worker_lines(audit.rows), footer(audit)]
    return "\n".join(lines)


def worker_lines(rows: Sequence[ProvenanceRow]) -> list[str]:
    """One line per worker: its groups, mean lag, median and largest lag-0 residual, groups rejected."""
    by: dict[str, list[ProvenanceRow]] = defaultdict(list)
    for r in rows:
        by[r.worker].append(r)
    out = []
    for worker, rs in sorted(by.items()):
        res = [r.residual for r in rs if r.residual is not None]
        judged = (f"residual median {statistics.median(res):.3f}, max {max(res):.3f} over {len(res)} lag-0"
                  if res else "no lag-0 group")
        rejected = sum(r.recompute == "rejected" for r in rs)
        out.append(f"worker {printable(worker)}: {len(rs)} groups, lag mean {statistics.fmean(r.lag for r in rs):.2f},"
                   f" {judged}, {rejected} rejected")
    return out


def footer(audit: Audit) -> str:
    """The last line: groups, steps, and what was skipped."""
    steps = len({r.step for r in audit.rows})
    text = f"run {printable(audit.run)}: {len(audit.rows)} groups over {steps} steps ({audit.objects} objects)"
    if not audit.objects:
        text += "; no provenance yet (its trainer has taken no step, or predates stoa audit)"
    if audit.skipped_lines or audit.skipped_objects:
        text += f"; skipped {audit.skipped_lines} malformed lines and {audit.skipped_objects} objects"
    return text
