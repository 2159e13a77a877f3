"""Reading provenance is a total function: every mutated or generated line either parses into a row whose fields
are within their bounds, or raises ``ValueError``; nothing else escapes. 20,000 inputs in about a second."""

from __future__ import annotations

import json
import random

from stoa.observe.audit import _rows
from stoa.schemas.provenance import RECOMPUTE_VERDICTS, REPLAY_VERDICTS, ProvenanceRow, parse_row

GOOD = ProvenanceRow(step=7, record="v00000006/w-1-00000003.rec", worker="w-1", version=6, lag=1, replay="ok",
                     tool_calls=2, recompute="ok", residual=0.01).line().encode()
VALUES = [None, True, False, 0, -1, 2**63, 1e308, -1e308, 1.5, "", "ok", "x" * 300, [], {}, [1], {"a": 1},
          "\ud800", "\x1b[2J"]


def mutate(rng: random.Random) -> bytes:
    """A byte-level mutation (flip, insert, delete, truncate) or a field set to a value of the wrong kind."""
    kind = rng.randrange(5)
    data = bytearray(GOOD)
    if kind == 0:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == 1:
        i = rng.randrange(len(data) + 1)
        data[i:i] = bytes(rng.choice([b"[", b"{", b"]", b'"', b"\\", b"\xff", b"1e999", b"NaN", b",", b"\n"]))
    elif kind == 2:
        i = rng.randrange(len(data))
        del data[i:i + rng.randint(1, 20)]
    elif kind == 3:
        del data[rng.randrange(len(data)):]
    else:
        obj = json.loads(GOOD)
        obj[rng.choice(list(obj))] = rng.choice(VALUES)
        return json.dumps(obj).encode("utf-8", "surrogatepass")
    return bytes(data)


def test_mutated_lines_parse_within_bounds_or_raise_value_error():
    rng = random.Random(0)
    parsed = refused = 0
    for _ in range(20_000):
        line = mutate(rng)
        try:
            row = parse_row(line)
        except ValueError:
            refused += 1
            continue
        parsed += 1
        assert row.step >= 1 and row.version >= 0 and row.tool_calls >= 0
        assert row.replay in REPLAY_VERDICTS and row.recompute in RECOMPUTE_VERDICTS
        assert len(row.worker) <= 128 and len(row.record) <= 200 and len(row.signature) <= 64
    assert parsed > 500 and refused > 5_000  # both sides exercised


def test_a_whole_object_of_mutations_never_raises():
    rng = random.Random(1)
    data = b"\n".join(mutate(rng) for _ in range(5_000))
    good, bad = _rows(data, 7)
    assert len(good) + bad <= 5_000 + data.count(b"\n") and bad > 0
