"""The hostile suite's own parts: the variants are what they claim, and each check catches what it checks."""

from __future__ import annotations

import json

import pytest

from tests.hostile import runner
from tests.hostile import variants as v
from tests.hostile.cell import ALLOWED, CellResult, _files, check, sandbox
from tests.hostile.matrix import Bases, table
from tests.hostile.objects import RUN, Plant


@pytest.fixture
def ctx(tmp_path) -> v.PlantContext:
    return v.PlantContext(tmp_path / "canary", 2, tmp_path / "huge")


HONEST = json.dumps({"version": 3, "files": {"a.bin": 12}, "name": "x"}).encode()


def _some(data: bytes | None) -> bytes:
    assert data is not None
    return data


def test_json_variants_are_what_they_claim(ctx) -> None:
    with pytest.raises(RecursionError):
        json.loads(v.deep(HONEST, ctx))
    huge = v.huge(HONEST, ctx)
    assert len(huge) > v.HUGE_BYTES and json.loads(huge) == json.loads(HONEST)
    assert json.loads(v.as_list(HONEST, ctx)) == [json.loads(HONEST)]
    assert json.loads(_some(v.str_int(HONEST, ctx)))["version"] == "3"
    assert v.utf16(HONEST, ctx)[:2] in (b"\xff\xfe", b"\xfe\xff")
    with pytest.raises(UnicodeDecodeError):
        v.bad_utf8(HONEST, ctx).decode()
    assert json.loads(_some(v.max_int(HONEST, ctx)))["files"]["a.bin"] == 2**63 - 1
    big = _some(v.huge_int(HONEST, ctx))
    assert big.count(b"1" + b"0" * v.BIG_DIGITS) == 2  # the version and the file size
    with pytest.raises(ValueError):
        json.loads(big)  # past Python's int-string limit
    assert v.str_int(json.dumps({"a": "b"}).encode(), ctx) is None  # nothing to turn


def test_traversal_variants_land_on_the_canary(ctx, tmp_path) -> None:
    bucket = tmp_path / "bucket"
    relative = json.loads(v.traversal(HONEST, ctx))
    key_dir = bucket / "runs" / RUN  # a key two levels below the bucket root: runs/r/x.json
    assert (key_dir / relative["name"]).resolve() == (tmp_path / "canary" / "secret.jsonl").resolve()
    assert any(k.endswith("canary/a.bin") for k in relative["files"])
    assert json.loads(v.absolute(HONEST, ctx))["name"] == str(tmp_path / "canary" / "secret.jsonl")


def test_signed_variants_fail_against_the_runs_key_only(hostile_bases: Bases, ctx) -> None:
    from stoa.contract import RunContract
    from stoa.weights.errors import SyncError
    from stoa.weights.pointer import Pointer

    run = hostile_bases["signed"].bucket / "runs" / RUN
    contract = (run / "run.json").read_bytes()
    key = RunContract.from_json(contract).run_key
    pointer = (run / "weights" / "current.json").read_bytes()
    Pointer.from_json(pointer).check_signature(key)
    for variant in (v.pointer_unsigned, v.pointer_other_key):
        with pytest.raises(SyncError):
            Pointer.from_json(variant(pointer, ctx)).check_signature(key)
    other = RunContract.from_json(v.contract_other_key(contract, ctx))
    assert len(key) == 64 and other.run_key != key  # self-consistent (from_json checks it), another key
    assert "signature" not in json.loads(v.contract_unsigned(contract, ctx))
    assert {"signature", "run_key"}.isdisjoint(json.loads(v.contract_downgraded(contract, ctx)))


def _result(code: int, stderr: str = "") -> CellResult:
    return CellResult("journal", "list", "status", runner.Outcome(code, "", stderr, 0.1))


def test_check_catches_a_traceback_a_bad_code_two_error_lines_and_a_write_outside(hostile_bases: Bases,
                                                                                     tmp_path) -> None:
    base = hostile_bases["toy"]
    box = tmp_path / "box"
    sandbox(box, base)
    before = _files(box, ALLOWED)
    ok = _result(3, "stoa: run contract mismatch\n")
    check(ok, box, base, before, [])
    assert ok.passed, ok.problems
    (box / "cwd" / "stray.txt").write_text("x")
    (box / "home" / "fine.txt").write_text("x")  # HOME is the client's to write
    bad = _result(1, "Traceback (most recent call last):\n  File x\nValueError: boom\nstoa: a\nstoa: b\n")
    check(bad, box, base, before, [])
    assert bad.problems[:3] == ["traceback", "exit code 1", "2 error lines"]
    assert bad.problems[3] == "wrote outside the bucket and cache: ['cwd/stray.txt']"
    hang = _result(runner.HANG)
    (box / "cwd" / "stray.txt").unlink()
    check(hang, box, base, before, [])
    assert hang.problems == ["hang past 30s", "exit code -1"]
    assert hang.outcome.line().startswith("hang (killed after 0s")
    note = "[worker] refused runs/r/weights/current.json: bad_pointer (x); retrying\n"
    for client, problems in (("worker", []), ("status", ["hang past 30s", "exit code -1"])):
        waiting = CellResult("pointer", "deep", client, runner.Outcome(runner.HANG, note, "", 25.0))
        check(waiting, box, base, before, [])
        assert waiting.problems == problems
    silent = CellResult("pointer", "deep", "worker", runner.Outcome(runner.HANG, note + "[worker] sampling\n", "", 25))
    check(silent, box, base, before, [])
    assert silent.problems == ["hang past 25s", "exit code -1"]


def test_check_catches_changed_acknowledged_data_and_the_canary_in_the_bucket(hostile_bases: Bases,
                                                                                tmp_path) -> None:
    base = hostile_bases["toy"]
    box = tmp_path / "box"
    sandbox(box, base)
    before = _files(box, ALLOWED)
    run = box / "bucket" / "runs" / RUN
    patch = sorted((run / "weights" / "versions").glob("*.patch"))[-1]
    patch.write_bytes(patch.read_bytes()[:-1] + b"\x00")
    (run / "rollouts" / "stolen.txt").write_text(v.CANARY_TOKEN)
    planted = Plant(f"runs/{RUN}/trainer/journal.json", b"[]")
    (box / "bucket" / planted.key).write_bytes(planted.data)
    r = _result(0)
    check(r, box, base, before, [planted])
    assert "canary content copied into the bucket" in r.problems
    assert f"acknowledged weights/versions/{patch.name} changed" in r.problems
    assert any(p.startswith("published weights no longer verify") for p in r.problems)
    assert (box / "bucket" / planted.key).read_bytes() == (base.bucket / planted.key).read_bytes()  # restored


def test_the_table_has_a_row_per_planted_object_and_a_column_per_client() -> None:
    rows = [CellResult("lease", "deep", "status", runner.Outcome(0, "", "", 0.1)),
            CellResult("lease", "deep", "trainer", runner.Outcome(1, "", "Traceback (most recent call last):\n"
                                                                   "RecursionError: deep\n", 0.1), ["traceback"]),
            CellResult("journal", "list", "status", runner.Outcome(4, "", "stoa: bucket error: x | y\n", 0.1))]
    assert table(rows).splitlines() == [
        "| planted | trainer | status |", "|---|---|---|",
        "| lease:deep | 1: traceback: RecursionError: deep **FAIL: traceback** | 0: ok |",
        "| journal:list |  | 4: stoa: bucket error: x \\| y |"]
