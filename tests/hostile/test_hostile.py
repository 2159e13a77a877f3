"""Hostile bucket objects, fast tier: a representative cell of each object type and client.

Each cell plants one crafted object in a live copy of a tiny run and starts one client against it (see
tests/hostile/cell.py for the sandbox and the checks). The whole matrix is tests/hostile/test_hostile_matrix.py
(slow) and ``python scripts/hostile_table.py`` (the table).
"""

from __future__ import annotations

import pytest

from tests.hostile.cell import run_cell
from tests.hostile.matrix import Bases, Cell
from tests.hostile.objects import object_types

FAST: list[tuple[str, str, str]] = [
    # the cheap clients: status, runs, plot, export, join-card
    ("contract", "deep", "status"), ("contract", "huge_int", "join-card"), ("contract", "list", "export"),
    ("contract", "bad_utf8", "runs"),
    ("pointer", "deep", "status"), ("pointer", "other_key", "export"), ("pointer", "max_int", "runs"),
    ("anchor_weights", "deep", "export"), ("patch", "garbage", "export"), ("anchor_manifest", "traversal", "export"),
    ("journal", "deep", "status"), ("lease", "deep", "status"), ("lease", "list", "runs"),
    ("status", "huge_int", "status"), ("status", "deep", "runs"),
    ("metrics_chunk", "huge_int", "status"), ("metrics_chunk", "deep", "plot"),
    ("evaluator_heartbeat", "deep", "status"), ("rollout_record", "huge", "status"),
    ("key_names", "newline", "status"), ("key_names", "backslash", "runs"), ("key_names", "control", "plot"),
    ("contract_path", "absolute", "join-card"),
    # the trainer, workers and the evaluator, on objects they read
    ("journal", "list", "trainer"), ("lease", "deep", "trainer"), ("checkpoint_pointer", "deep", "trainer"),
    ("key_names", "backslash", "trainer"), ("rollout_record", "garbage", "trainer"),
    ("pointer_unsigned_run", "max_int", "trainer"),
    ("contract", "deep", "worker"), ("contract", "other_key", "worker"), ("contract_path", "unpinned", "worker"),
    ("retriever_manifest", "deep", "worker"), ("patch", "garbage", "worker"),
    ("contract", "huge_int", "eval"), ("metrics_chunk", "huge_int", "eval"), ("pointer", "unsigned", "eval"),
]


def _cell(obj: str, variant: str, client: str) -> Cell:
    found = {o.name: o for o in object_types()}
    return Cell(found.get(obj), variant, client)


def test_the_fast_cells_name_real_objects_variants_and_readers() -> None:
    for obj, variant, client in FAST:
        cell = _cell(obj, variant, client)
        if cell.obj is None:
            assert obj == "key_names"
            continue
        assert variant in cell.obj.variants, (obj, variant)


@pytest.mark.parametrize("obj,variant,client", FAST, ids=[f"{o}:{v}-{c}" for o, v, c in FAST])
def test_a_planted_object_is_refused_in_one_line_or_survived(obj, variant, client, hostile_bases: Bases,
                                                               hostile_work) -> None:
    cell = _cell(obj, variant, client)
    result = run_cell(cell.obj, variant, client, hostile_bases[cell.base], hostile_work / "cell",
                      hostile_work / "huge")
    assert result is not None, "the variant planted nothing"
    assert result.passed, (f"{cell.row} x {client}: exit {result.outcome.code}: {result.outcome.line()}; "
                           f"{result.problems}\n{result.outcome.stderr[-3000:]}")
