"""The ``stoa status`` screen: :func:`render` turns a :class:`~stoa.observe.snapshot.Snapshot` into text."""

from __future__ import annotations

import time

from stoa.lifecycle import age
from stoa.observe.aggregate import WorkerView
from stoa.observe.costview import cost_lines
from stoa.observe.snapshot import Snapshot
from stoa.observe.spark import bar, sparkline

LABEL = 11
"""Width of the left column."""


def size(n: int) -> str:
    """Bytes as ``512 B``, ``1.2 kB``, ``3.4 MB``, ``5.6 GB``.

    Args:
        n: bytes.
    """
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def _line(label: str, text: str) -> str:
    return f"{label:<{LABEL}}{text}"


def _curve(label: str, values: list[float | None], unit: str, width: int) -> str:
    finite = [v for v in values if v is not None]
    if not finite:
        return _line(label, "-")
    return _line(label, f"{sparkline(values, width)}  {_fmt(finite[0])} -> {_fmt(finite[-1])} "
                        f"(min {_fmt(min(finite))}, max {_fmt(max(finite))}, {len(values)} {unit})")


def _progress(s: Snapshot) -> str:
    """``12/30``, ``12 (no target)`` for an unbounded run, or the step alone when the target is unknown."""
    step = "-" if s.step is None else str(s.step)
    if s.target_steps is None:
        return step
    return f"{step}/{s.target_steps}" if s.target_steps else f"{step} (no target)"


def _eta(s: Snapshot) -> str:
    return "" if s.eta_s is None else f" | ETA {age(s.eta_s)}"


def _head(s: Snapshot) -> list[str]:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.taken_at))
    state = f"{s.state} (heartbeat {age(s.heartbeat_age_s)} ago)" if s.heartbeat_age_s is not None else s.state
    if s.wanted_groups is not None and s.state == "running":
        state += f", wants {s.wanted_groups} groups"
    version = (f"v{s.version} ({s.plane}), published {age(s.version_age_s)} ago" if s.version is not None
               else "no weights published yet")
    t = s.trainer
    trainer = ("no lease" if t is None else f"{t.host} pid {t.pid} (holder {t.holder}, epoch {t.epoch}), "
               f"heartbeat {age(t.heartbeat_age_s)} ago" + (", released" if t.released else ""))
    steps = (f"{_progress(s)} | {_fmt(s.steps_per_min, '.2f')} steps/min{_eta(s)} | "
             f"{_fmt(s.records_per_s, '.2f')} records/s (last {min(len(s.reward), 20)} steps)")
    return [f"stoa status | run {s.run} | {s.bucket} | {when}", _line("state", state), _line("version", version),
            _line("trainer", trainer), _line("steps", steps)]


def _curves(s: Snapshot, width: int) -> list[str]:
    lines = [_curve("reward", s.reward, "steps", width)]
    for name, label in (("accuracy", "eval acc"), ("cover_em", "eval cEM")):
        values = [e.get(name) for e in s.evals]
        if any(v is not None for v in values):
            lines.append(_curve(label, values, "evals", width))
    if not s.evals:
        lines.append(_line("eval", "-"))
    top = max(s.lag.values(), default=0)
    lines += [_line("lag" if i == 0 else "", f"{k:>3} {bar(v, top, 30):<30} {v}") for i, (k, v) in
              enumerate(s.lag.items())] or [_line("lag", "-")]
    rejected = ", ".join(f"{k} {v}" for k, v in s.rejected.items()) or "none"
    lines.append(_line("rejected", rejected + (f" | {s.quarantined} workers quarantined" if s.quarantined else "")))
    return lines


def _worker_row(w: WorkerView) -> str:
    versions = "-" if not w.versions else f"v{w.versions[0]}" if w.versions[0] == w.versions[1] else \
        f"v{w.versions[0]}-v{w.versions[1]}"
    rejected = "-" if w.rejected is None else str(w.rejected) + (f" ({w.quarantine})" if w.quarantine else "")
    seen = "-" if w.last_seen_age_s is None else f"{age(w.last_seen_age_s)} ago"
    return (f"  {w.name[:28]:<28} {w.engine or '-':<6} {versions:<13} {w.groups:>6} {_fmt(w.tokens_per_s, '.1f'):>8} "
            f"{_fmt(w.sync_s, '.2f'):>7} {rejected:>9} {seen:>10} {w.source}")


def _workers(s: Snapshot) -> list[str]:
    head = f"workers    {len(s.workers)} seen in the last {s.workers_minutes:g} min"
    if not s.workers:
        return [head]
    cols = (f"  {'name':<28} {'engine':<6} {'versions':<13} {'groups':>6} {'tok/s':>8} {'sync s':>7} "
            f"{'rejected':>9} {'seen':>10} from")
    return [head, cols, *(_worker_row(w) for w in s.workers)]


def _footer(s: Snapshot) -> list[str]:
    total = sum(p.bytes for p in s.sizes.values())
    parts = " | ".join(f"{k} {size(p.bytes)} ({p.objects})" for k, p in s.sizes.items() if p.objects)
    r = s.requests
    lines = [_line("bucket", f"{size(total)}: {parts}"),
             _line("requests", f"{r.get('list', 0)} LIST, {r.get('get', 0)} GET ({r.get('listed_objects', 0)} "
                               f"objects listed, {r.get('cached_chunks', 0)} metrics chunks cached)"),
             *cost_lines(s.cost, LABEL)]
    if s.bad_rows or s.bad_chunks:
        lines.append(_line("skipped", f"{s.bad_rows} malformed metrics rows, {s.bad_chunks} oversized chunks"))
    return lines


def render(s: Snapshot, width: int = 60) -> str:
    """The status screen.

    Args:
        s: the snapshot.
        width: sparkline cells.
    """
    return "\n".join([*_head(s), *_curves(s, width), *_workers(s), *_footer(s)])
