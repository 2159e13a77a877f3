"""Hostile record headers reach the header parser and are counted rejections, in both record schema versions.

Each case re-encodes a good record with raw JSON text spliced into its header, under the header layout of the
schema it claims (schema 1 has no ``env_seed`` and no per-sample ``turns``/``calls``/``end``, nor roles in the
payload), with valid framing and digest: only the spliced value can be refused. A control case splices an
acceptable value and must be accepted, so the hostile ones are known to be parsed, not refused for their shape.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import xxhash

from stoa.layout import rollout_key
from stoa.rollouts.records import RECORD_MAGIC, RecordRejected, RolloutRecord
from tests.test_pool import make_pool, put, setup  # noqa: F401  (setup is a fixture)

_V2_ONLY = ("turns", "calls", "end")
_SAMPLE_FIELDS = ("reward", "len", "finish", *_V2_ONLY)

HOSTILE = [
    ({"reward": "1" + "0" * 400}, "literal of 401"),  # overflows float()
    ({"policy_version": "1" + "0" * 400}, "literal of 401"),
    ({"created_at": "1" + "0" * 400}, "literal of 401"),
    ({"reward": "NaN"}, "NaN"),
    ({"reward": "1e999"}, "1e999"),
    ({"seq": "true"}, "seq"),  # a boolean where an integer belongs: true == 1 == the key's seq
    ({"policy_version": "true"}, "policy_version"),  # true == 1 == the record's version
    ({"seq": "1.0"}, "seq"),
    ({"reward": "true"}, "reward"),
    ({"created_at": "false"}, "created_at"),
    ({"len": "-1"}, "len"),
]


def with_header(rec: RolloutRecord, patch: dict[str, str], schema: int) -> bytes:
    """``rec`` encoded as a record of ``schema`` with raw JSON text spliced into its header."""
    body = rec.encode()[:-16]
    hlen = struct.unpack_from("<8sHHI", body)[3]
    header = json.loads(body[16 : 16 + hlen])
    if schema == 1:
        del header["env_seed"]
        for meta in header["samples"]:
            for name in _V2_ONLY:
                del meta[name]
    placeholders = {}
    for i, (name, text) in enumerate(patch.items()):
        target = header["samples"][0] if name in _SAMPLE_FIELDS else header
        target[name] = f"@@{i}@@"
        placeholders[f'"@@{i}@@"'] = text
    htext = json.dumps(header, separators=(",", ":"))
    for ph, text in placeholders.items():
        htext = htext.replace(ph, text)
    hbytes = htext.encode()
    payload = [np.ascontiguousarray(rec.prompt_tokens, "<i4").tobytes()]
    for s in rec.samples:
        payload += [np.ascontiguousarray(s.tokens, "<i4").tobytes(), np.ascontiguousarray(s.logprobs, "<f4").tobytes()]
        if schema >= 2:
            payload.append(s.role_array().tobytes())
    new = struct.pack("<8sHHI", RECORD_MAGIC, schema, 0, len(hbytes)) + hbytes + b"".join(payload)
    return new + xxhash.xxh3_128_digest(new)


def second(setup) -> RolloutRecord:  # noqa: F811
    """A good record (seq 1) beside the good one the pool also lists (seq 0), with content of its own."""
    rec = RolloutRecord.decode(setup[0].get(put(*setup, seq=0)))
    rec.seq = 1
    for s in rec.samples:
        s.logprobs = s.logprobs - 0.25
    return rec


def intake(setup, raw: bytes) -> tuple[int, dict]:  # noqa: F811
    """Accepted count and rejections of a pool that lists a good record (seq 0) and ``raw`` (seq 1)."""
    bucket = setup[0]
    bucket.put_create(rollout_key("r", 1, "w", 1), raw)
    pool = make_pool(*setup)
    return pool.refresh(1), dict(pool.drain_stats().rejected)


@pytest.mark.parametrize("schema", [1, 2])
@pytest.mark.parametrize("patch", [{}, {"seq": "1"}, {"reward": "0.5", "created_at": "12"}])
def test_acceptable_spliced_values_are_accepted(setup, schema, patch):  # noqa: F811
    """The control: the spliced record is well formed in its schema, so the hostile cases reach the parser."""
    good = second(setup)
    raw = with_header(good, patch, schema)
    assert RolloutRecord.decode(raw).schema_version == schema
    assert intake(setup, raw) == (2, {})


@pytest.mark.parametrize("schema,patch,named", [(1, p, n) for p, n in HOSTILE]
                         + [(2, p, n) for p, n in HOSTILE + [({"env_seed": "true"}, "env_seed")]])
def test_hostile_headers_are_counted_rejections(setup, schema, patch, named):  # noqa: F811
    good = second(setup)
    raw = with_header(good, patch, schema)
    with pytest.raises(RecordRejected) as e:
        RolloutRecord.decode(raw)
    assert e.value.reason == "malformed" and named in str(e.value), e.value  # refused for the value, not the shape
    assert intake(setup, raw) == (1, {"malformed": 1})  # the good one; the hostile one is a counted rejection


@pytest.mark.parametrize("schema,depth", [(1, 3), (2, 5)])
def test_deep_nesting_is_refused_before_parsing(setup, schema, depth):  # noqa: F811
    good = second(setup)
    raw = with_header(good, {"sampling": "[" * 5000 + "]" * 5000}, schema)
    with pytest.raises(RecordRejected) as e:
        RolloutRecord.decode(raw)
    assert f"> {depth}" in str(e.value), e.value
    assert intake(setup, raw) == (1, {"malformed": 1})
