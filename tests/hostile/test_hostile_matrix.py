"""Hostile bucket objects, the whole matrix (slow): every variant of every object type against every client
that reads it, one test per object type; and a few cells as fresh ``python -m stoa`` processes, which must
agree with the forked ones."""

from __future__ import annotations

import pytest

from tests.hostile.cell import run_cell
from tests.hostile.matrix import Bases, cells, run_cells
from tests.hostile.objects import object_types

OBJECTS = [o.name for o in object_types()] + ["key_names"]


@pytest.mark.slow
@pytest.mark.parametrize("obj", OBJECTS)
def test_every_variant_against_every_reader(obj: str, hostile_bases: Bases, hostile_work) -> None:
    results = run_cells(cells(only=[obj]), hostile_bases, hostile_work / "matrix", jobs=2)
    assert results
    failed = [f"{r.obj}:{r.variant} x {r.client}: exit {r.outcome.code}: {r.outcome.line()[:160]} {r.problems}"
              for r in results if not r.passed]
    assert not failed, f"{len(failed)} of {len(results)} cells failed:\n" + "\n".join(failed)


@pytest.mark.slow
@pytest.mark.parametrize("obj,variant,client", [("contract", "huge_int", "worker"), ("journal", "list", "trainer"),
                                                ("lease", "deep", "status")])
def test_a_fresh_process_does_what_the_forked_one_does(obj, variant, client, hostile_bases: Bases,
                                                       hostile_work) -> None:
    found = {o.name: o for o in object_types()}[obj]
    base = hostile_bases[found.base]
    forked = run_cell(found, variant, client, base, hostile_work / "fork", hostile_work / "huge")
    spawned = run_cell(found, variant, client, base, hostile_work / "spawn", hostile_work / "huge", spawn=True)
    assert forked is not None and spawned is not None
    assert (spawned.outcome.code, spawned.outcome.traceback) == (forked.outcome.code, forked.outcome.traceback)
    assert len(spawned.outcome.error_lines) == len(forked.outcome.error_lines)  # their text names each sandbox
