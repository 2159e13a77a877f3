"""``stoa audit`` reads provenance as hostile input: bad lines and objects are skipped and counted, never a
traceback; what is printed of a hostile name is escaped."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, cast

import pytest

from stoa.bucket import open_bucket
from stoa.cli import main
from stoa.layout import contract_key, provenance_key, provenance_prefix
from stoa.observe import audit as audit_mod
from stoa.observe.audit import read_audit, render
from stoa.schemas.provenance import ProvenanceRow, encode_rows, parse_row

GOOD = ProvenanceRow(step=3, record="v00000002/w1-00000004.rec", worker="w1", version=2, lag=1)

HOSTILE_LINES = [
    b"not json",
    b"[1, 2]",
    b"[" * 50 + b"]" * 50,
    json.dumps({**json.loads(GOOD.line()), "worker": "x" * 5000}).encode(),  # over MAX_LINE_BYTES
    GOOD.line().replace('"step":3', '"step":true').encode(),  # a bool is not a step
    GOOD.line().replace('"lag":1', '"lag":1e999').encode(),
    GOOD.line().replace('"residual":null', '"residual":NaN').encode(),
    GOOD.line().replace('"replay":"-"', '"replay":"trust me"').encode(),
    GOOD.line().replace('"version":2', '"version":-1').encode(),
    GOOD.line().replace('"worker":"w1",', "").encode(),  # a field missing
    b'{"step": 3, "worker": "\xff\xfe"}',  # not UTF-8
]

WRONG_STEP = GOOD.line().replace('"step":3', '"step":4').encode()
"""A line that parses but names another step than its object (a row copied into another step's object)."""


@pytest.fixture
def bucket(tmp_path):
    b = open_bucket(str(tmp_path / "b"))
    b.put_create(contract_key("r"), b"{}")
    return b


def test_every_hostile_line_is_skipped_and_counted_and_the_good_ones_kept(bucket):
    bucket.put_create(provenance_key("r", 3), b"\n".join([GOOD.line().encode(), *HOSTILE_LINES, WRONG_STEP, b"",
                                                          GOOD.line().encode()]))
    got = read_audit(bucket, "r")
    assert got.rows == (GOOD, GOOD) and got.skipped_lines == len(HOSTILE_LINES) + 1 and got.objects == 1


def test_each_hostile_line_alone_is_refused():
    for line in HOSTILE_LINES:
        with pytest.raises(ValueError):
            parse_row(line)
    assert parse_row(GOOD.line().encode()) == GOOD


class Reads:
    """A bucket that records the keys read and can report every listed size as 0 (a listing that lies)."""

    def __init__(self, inner, lie: bool = False) -> None:
        self.inner, self.lie, self.read = inner, lie, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get_range(self, key, start, end):
        self.read.append(key)
        return self.inner.get_range(key, start, end)

    def list(self, prefix, start_after=None):
        return (dataclasses.replace(o, size=0) if self.lie else o for o in self.inner.list(prefix, start_after))


def test_oversize_and_foreign_objects_are_not_read(bucket, monkeypatch):
    monkeypatch.setattr(audit_mod, "MAX_PROVENANCE_BYTES", 1000)
    bucket.put_create(provenance_key("r", 1), encode_rows([GOOD] * 10))  # over 1,000 bytes: never fetched
    bucket.put_create(provenance_prefix("r") + "s1.jsonl", encode_rows([GOOD]))  # unpadded step
    bucket.put_create(provenance_prefix("r") + "evil.jsonl", encode_rows([GOOD]))
    bucket.put_create(provenance_key("r", 3), encode_rows([GOOD]))
    reads = Reads(bucket)
    got = read_audit(cast(Any, reads), "r")
    assert (got.rows, got.objects, got.skipped_objects) == ((GOOD,), 1, 3)
    assert reads.read == [provenance_key("r", 3)]
    lying = read_audit(cast(Any, Reads(bucket, lie=True)), "r")  # fetched, then refused for its size
    assert (lying.rows, lying.objects, lying.skipped_objects) == ((GOOD,), 1, 3)


def test_the_command_reports_the_skips_and_escapes_hostile_names(bucket, capsys):
    evil = ProvenanceRow(step=3, record="v00000002/w1-00000004.rec", worker="w\x1b[2J", version=2, lag=1)
    bucket.put_create(provenance_key("r", 3), encode_rows([GOOD, evil]) + b"garbage\n")
    assert main(["audit", "--bucket", str(bucket.root), "--run", "r"]) == 0
    captured = capsys.readouterr()
    assert "\x1b" not in captured.out and "'w\\x1b[2J'" in captured.out
    assert "skipped 1 malformed lines and 0 objects" in captured.out and "Traceback" not in captured.err
    assert "\x1b" not in render(read_audit(bucket, "r"))


def test_a_run_without_provenance_says_so_and_a_bad_step_is_a_usage_error(bucket, capsys):
    assert main(["audit", "--bucket", str(bucket.root), "--run", "r"]) == 0
    assert "no provenance yet" in capsys.readouterr().out
    assert main(["audit", "--bucket", str(bucket.root), "--run", "r", "--step", "0"]) == 2
    assert "--step must be >= 1" in capsys.readouterr().err
