"""The identity decoders are total and accept nothing forged: statements, signed record trailers, worker key files,
join cards that carry a worker key.

Every mutation of a stored identity either fails with ``IdentityError`` of a named reason or still reads as the
very statement that was signed; every mutation of a signed record (resealed with a fresh digest, so it reaches
the signature) is a ``RecordRejected`` of a known reason or the record as signed; a mutated key file is a
``RunKeyError`` or the same key. Nothing else escapes.
"""

from __future__ import annotations

import json
import random
import struct
import tomllib
from collections import Counter

import numpy as np
import pytest
import xxhash

from stoa.bucket import open_bucket
from stoa.contract import RunKeyError
from stoa.identity import (
    IDENTITY_REASONS,
    IdentityBook,
    IdentityError,
    Statement,
    issue_key,
    load_worker_key,
    write_worker_key,
)
from stoa.join.card import CardError, JoinCard, card_toml, read_card
from stoa.join.cardkey import install_card_key, with_key
from stoa.layout import rollout_key
from stoa.rollouts.records import REJECT_REASONS, RecordRejected, RolloutRecord, Sample, record_signature
from stoa.weights.signing import create_key

KEY = rollout_key("r", 1, "alice-a1b2c3", 0)
JUNK = [True, False, None, 0, -1, 2**63, 1.5, 1e300, "", "x" * 300, "\ud800", [], {}, [1, [2]], {"a": {"b": 1}},
        "ab" * 32, "AB" * 32, "00" * 64, "0" * 127]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz-identity")
    signer = create_key(tmp / "run.ed25519")
    bucket = open_bucket(str(tmp / "b"))
    alice, identity = issue_key(bucket, "r", "alice", signer, now=1_800_000_000)
    book = IdentityBook(bucket, "r", signer.public_hex, clock=lambda: 1_800_000_000)
    book.refresh()
    rec = RolloutRecord("alice-a1b2c3", 0, 1, "f" * 16, "toy", "train:1", np.arange(3, 9, dtype=np.int32),
                        [Sample(np.arange(5, 12, dtype=np.int32), np.full(7, -1.0, np.float32), 1.0, "stop")])
    return signer, identity, alice, book, rec.encode(sign=alice.record_signer(KEY)), tmp


def _mutate_statement(rng: random.Random, good: bytes) -> bytes:
    obj = json.loads(good)
    kind = rng.randrange(5)
    if kind == 0:  # one field replaced by junk or dropped
        field = rng.choice(sorted(obj))
        if rng.random() < 0.2:
            del obj[field]
        else:
            obj[field] = rng.choice(JUNK)
        return json.dumps(obj).encode()
    if kind == 1:  # a field's value edited a little (the signature must catch it)
        field = rng.choice(["run", "worker", "public_key", "at", "kind", "signature"])
        value = obj[field]
        obj[field] = value + rng.choice([-1, 1]) if isinstance(value, int) else (
            value[:-1] + rng.choice("0af") if value else "a")
        return json.dumps(obj).encode()
    data = bytearray(good)
    if kind == 2:  # bytes flipped
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if kind == 3:  # truncated or padded
        return bytes(data[: rng.randrange(len(data))]) if rng.random() < 0.5 else bytes(data) + b" " * 3000
    return json.dumps(obj, indent=rng.choice([None, 1])).encode()  # the same statement, spelled otherwise


def test_no_mutated_statement_reads_as_another_signed_one(world):
    signer, identity, *_ = world
    rng, outcomes = random.Random(29), Counter()
    for _ in range(3000):
        data = _mutate_statement(rng, identity.to_json())
        try:
            st = Statement.parse(data)
            st.check("r", signer.public_hex)
        except IdentityError as e:
            assert e.reason in IDENTITY_REASONS, e.reason
            outcomes[e.reason] += 1
            continue
        assert st == identity  # accepted only as the statement that was signed
        outcomes["same"] += 1
    assert outcomes["identity_malformed"] > 300 and outcomes["identity_forged"] > 100 and outcomes["same"] > 100


def _mutate_record(rng: random.Random, good: bytes) -> bytes:
    body = bytearray(good[:-16])
    kind = rng.randrange(4)
    if kind == 0:  # bytes flipped anywhere, header, payload, key or signature
        for _ in range(rng.randint(1, 3)):
            body[rng.randrange(len(body))] ^= 1 << rng.randrange(8)
    elif kind == 1:  # the schema says signed or not
        struct.pack_into("<H", body, 8, rng.choice([1, 2, 3, 4]))
    elif kind == 2:  # a trailer cut, grown or swapped for junk
        cut = rng.randint(1, 120)
        body = body[:-cut] + (bytearray(rng.randbytes(rng.choice([0, cut, 96]))) if rng.random() < 0.7 else b"")
    else:  # truncated, unsealed
        return bytes(good[: rng.randrange(len(good))])
    return bytes(body) + xxhash.xxh3_128_digest(bytes(body))


def test_no_mutated_signed_record_passes_as_anything_but_itself(world):
    _, _, alice, book, good, _ = world
    signed = record_signature(good)
    assert signed is not None
    rng, outcomes = random.Random(7), Counter()
    for _ in range(3000):
        data = _mutate_record(rng, good)
        try:
            public = book.check_record(KEY, "alice-a1b2c3", data)
        except RecordRejected as e:
            assert e.reason in REJECT_REASONS, e.reason
            outcomes[e.reason] += 1
            continue
        assert public == alice.public_hex and record_signature(data) == signed
        outcomes["same"] += 1
    assert outcomes["signature"] > 300 and outcomes["unsigned"] > 100 and outcomes["identity_unknown"] > 50


def test_a_mutated_worker_key_file_is_a_run_key_error(world):
    _, _, alice, _, _, tmp = world
    path = tmp / "alice.key"
    write_worker_key(path, alice)
    good = path.read_bytes()
    rng = random.Random(3)
    for i in range(500):
        data = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        (tmp / f"m{i % 8}.key").write_bytes(bytes(data))
        try:
            key = load_worker_key(tmp / f"m{i % 8}.key", "r")
        except RunKeyError:
            continue
        assert key.public_hex == alice.public_hex  # a flip the format shrugs off, or in the (unsigned) name


def test_a_mutated_keyed_join_card_is_a_card_error_or_a_card_whose_key_installs(world, monkeypatch):
    _, _, alice, _, _, tmp = world
    monkeypatch.setenv("STOA_KEY_DIR", str(tmp / "installed"))
    card = with_key(JoinCard(bucket="b", run="r", n_samples=2, plane="bf16", task="toy", contract="c"), alice)
    good = card_toml(card).encode()
    rng = random.Random(4)
    outcomes: Counter[str] = Counter()
    for i in range(500):
        data = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        path = tmp / f"c{i % 8}.toml"
        path.write_bytes(bytes(data))
        try:
            got = read_card(path)
            if got.worker_key:
                install_card_key(got, dry_run=True)
        except CardError:
            outcomes["refused"] += 1
            continue
        outcomes["read"] += 1
    assert outcomes["refused"] > 100 and outcomes["read"] > 0
    fields = tomllib.loads(good.decode())
    for junk in JUNK:  # every field a card's key rides on, set to each hostile value
        for name in ("worker", "worker_key"):
            path.write_text(json.dumps({**fields, name: junk}))
            try:
                got = read_card(path)
                if got.worker_key:
                    install_card_key(got, dry_run=True)
            except CardError:
                continue
