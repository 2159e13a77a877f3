"""The hostile matrix: which cells run, the base runs they need, and the Markdown table of their outcomes."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tests.hostile import bases
from tests.hostile.cell import CellResult, run_cell
from tests.hostile.objects import ALL_CLIENTS, KEY_NAMES, ObjectType, object_types

KEY_READERS = ("trainer", "status", "runs", "plot", "export")
"""The clients that list the prefixes hostile key names are planted under."""


@dataclass(frozen=True)
class Cell:
    """One planted object (``obj`` None: a hostile key name) and the client started against it."""

    obj: ObjectType | None
    variant: str
    client: str

    @property
    def base(self) -> str:
        return self.obj.base if self.obj else "toy"

    @property
    def row(self) -> str:
        return f"{self.obj.name if self.obj else 'key_names'}:{self.variant}"


def cells(everything: bool = False, only: Iterable[str] = ()) -> list[Cell]:
    """The matrix: every object type and variant against the clients that read it (``everything``: against
    every client); ``only`` keeps the object types named there (``key_names`` for the key names)."""
    keep = set(only)
    out = []
    for obj in object_types():
        if keep and obj.name not in keep:
            continue
        clients = ALL_CLIENTS if everything else obj.readers
        out += [Cell(obj, name, c) for name in obj.variants for c in clients]
    if not keep or "key_names" in keep:
        out += [Cell(None, name, c) for name in KEY_NAMES for c in (ALL_CLIENTS if everything else KEY_READERS)]
    return out


class Bases:
    """Base runs built on first use under ``root`` (the tiny model copied from ``model_cache``)."""

    def __init__(self, root: Path, model_cache: Path) -> None:
        self.root, self.model_cache, self.built = root, model_cache, {}

    def __getitem__(self, kind: str) -> bases.Base:
        if kind not in self.built:
            self.built[kind] = bases.build(kind, self.root / kind, self.model_cache)
        return self.built[kind]


def run_cells(todo: list[Cell], the_bases: Bases, work: Path, echo: Callable[[CellResult], None] = lambda r: None,
              jobs: int = 1) -> list[CellResult]:
    """Run each cell in its own sandbox under ``work`` (``jobs`` at a time, each slot reusing its sandbox
    directory); inapplicable ones are left out of the result, the others come back in ``todo``'s order."""
    for kind in dict.fromkeys(c.base for c in todo):
        the_bases[kind]  # built before the cells start, one at a time
    slots: queue.Queue[int] = queue.Queue()
    for i in range(jobs):
        slots.put(i)

    def one(cell: Cell) -> CellResult | None:
        slot = slots.get()
        try:
            result = run_cell(cell.obj, cell.variant, cell.client, the_bases[cell.base], work / f"cell{slot}",
                              work / "huge")
        finally:
            slots.put(slot)
        if result is not None:
            echo(result)
        return result

    with ThreadPoolExecutor(jobs) as pool:
        return [r for r in pool.map(one, todo) if r is not None]


def _text(result: CellResult) -> str:
    line = result.outcome.line().replace("|", "\\|").replace("\n", " ")
    line = line if len(line) <= 140 else line[:137] + "..."
    problems = "; ".join(result.problems)[:160].replace("|", "\\|")
    mark = "" if result.passed else f" **FAIL: {problems}**"
    return f"{result.outcome.code}: {line}{mark}"


def table(results: list[CellResult]) -> str:
    """Planted object x client -> exit code and the line the client printed (or ``ok``), as Markdown; a failed
    cell names its failed checks in bold; a blank cell was not run."""
    clients = [c for c in ALL_CLIENTS if any(r.client == c for r in results)]
    rows: dict[str, dict[str, CellResult]] = {}
    for r in results:
        rows.setdefault(f"{r.obj}:{r.variant}", {})[r.client] = r
    lines = ["| planted | " + " | ".join(clients) + " |", "|---" * (len(clients) + 1) + "|"]
    for row, by_client in rows.items():
        lines.append(f"| {row} | " + " | ".join(_text(by_client[c]) if c in by_client else "" for c in clients) + " |")
    return "\n".join(lines)


def summary(results: list[CellResult], seconds: float) -> str:
    """One line: cells run, passed, failed, tracebacks, hangs, and the time taken."""
    failed = [r for r in results if not r.passed]
    tracebacks = sum(r.outcome.traceback for r in results)
    hangs = sum("hang" in " ".join(r.problems) for r in results)
    return (f"{len(results)} cells, {len(results) - len(failed)} passed, {len(failed)} failed "
            f"({tracebacks} tracebacks, {hangs} hangs) in {seconds:.0f}s")


def timed(fn: Callable[[], list[CellResult]]) -> tuple[list[CellResult], float]:
    """``fn()`` and its wall time."""
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0
