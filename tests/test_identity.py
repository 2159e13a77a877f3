"""Worker identities: signed records, operator-signed identities and revocations, and the pool's named refusals.

Every refusal of an identity is a named ``RecordRejected`` reason that is never held against the worker id the
record names, and none trains a group.
"""

from __future__ import annotations

import dataclasses
import json
import stat

import pytest
import xxhash

from stoa.contract import RunKeyError
from stoa.identity import (
    IDENTITY_REASONS,
    IdentityBook,
    Statement,
    issue_key,
    load_worker_key,
    name_of,
    new_worker_key,
    revoke_keys,
    sign_statement,
    worker_keys_wanted,
    write_worker_key,
)
from stoa.layout import identity_key, parse_identity_key, parse_revocation_key, revocation_key, rollout_key
from stoa.rollouts.records import REJECT_REASONS, RolloutRecord, record_signature
from stoa.trainer.pool import RecordPool
from stoa.trainer.quarantine import Quarantine
from stoa.weights.signing import create_key
from tests.test_pool import GateSpy, put, setup  # noqa: F401 - the fixture

NOW = 1_800_000_000


@pytest.fixture
def keyed(setup, tmp_path):  # noqa: F811 - the fixture
    """The pool test's run, with a run key and one issued worker, ``alice``."""
    bucket, contract, task, codec = setup
    signer = create_key(tmp_path / "keys" / "r.ed25519")
    alice, _ = issue_key(bucket, "r", "alice", signer, now=NOW)
    return bucket, contract, task, codec, signer, alice


def signed_put(keyed, key=None, *, worker="alice-a1b2c3", seq=0, mutate=None):
    """Store a record under ``worker`` signed by ``key`` (default alice's); ``mutate(body) -> body`` edits the
    signed bytes after signing (the digest is recomputed, so only the signature can tell)."""
    bucket, contract, task, codec, _, alice = keyed
    rk = put(bucket, contract, task, codec, worker=worker, seq=seq)
    rec = RolloutRecord.decode(bucket.get(rk))
    data = rec.encode(sign=(key or alice).record_signer(rk))
    if mutate is not None:
        body = mutate(bytearray(data[:-16]))
        data = bytes(body) + xxhash.xxh3_128_digest(bytes(body))
    bucket.delete(rk)
    bucket.put_create(rk, data)
    return rk


def intake(keyed, gate=None, clock=lambda: NOW):
    bucket, contract, task, codec, signer, _ = keyed
    book = IdentityBook(bucket, "r", signer.public_hex, clock=clock)
    pool = RecordPool(bucket, contract, task, codec, staleness_bound=3, reuse_cap=2, gate=gate, identities=book)
    pool.refresh(1)
    return pool, pool.drain_stats()


def test_a_signed_record_round_trips_and_an_unsigned_one_still_decodes(keyed):
    bucket, contract, task, codec, _, alice = keyed
    rk = put(bucket, contract, task, codec, worker="alice-a1b2c3")
    plain = RolloutRecord.decode(bucket.get(rk))
    data = plain.encode(sign=alice.record_signer(rk))
    back = RolloutRecord.decode(data)
    assert back.schema_version == 3 and plain.schema_version == 2 and back.content_id() == plain.content_id()
    assert back.encode() == plain.encode() and record_signature(plain.encode()) is None
    signed = record_signature(data)
    assert signed is not None and signed.public_key.hex() == alice.public_hex and len(signed.signature) == 64
    assert set(IDENTITY_REASONS) <= set(REJECT_REASONS)


def test_a_record_signed_by_an_issued_worker_trains(keyed):
    rk = signed_put(keyed)
    pool, stats = intake(keyed)
    assert stats.accepted == 1 and not stats.rejected
    assert next(iter(pool.entries.values())).signer == keyed[5].public_hex and pool.entries[
        next(iter(pool.entries))].key == rk


def _other_run_identity(keyed, tmp_path):
    """Bob's key with an identity the other run's key signed, stored in this run."""
    bucket = keyed[0]
    other = create_key(tmp_path / "keys" / "other.ed25519")
    bob = new_worker_key("r", "bob")
    st = sign_statement(other, "identity", "r", "bob", bob.public_hex, NOW)
    bucket.put_create(identity_key("r", "bob", bob.public_hex), st.to_json())
    return bob


def _wrong_run_identity(keyed, tmp_path):
    """Bob's identity from run "r2" (signed by this operator's key) copied into run "r"."""
    bucket, signer = keyed[0], keyed[4]
    bob = new_worker_key("r", "bob")
    st = sign_statement(signer, "identity", "r2", "bob", bob.public_hex, NOW)
    bucket.put_create(identity_key("r", "bob", bob.public_hex), st.to_json())
    return bob


def _short_signature_identity(keyed, tmp_path):
    bucket, signer = keyed[0], keyed[4]
    bob = new_worker_key("r", "bob")
    st = sign_statement(signer, "identity", "r", "bob", bob.public_hex, NOW)
    bucket.put_create(identity_key("r", "bob", bob.public_hex),
                      dataclasses.replace(st, signature=st.signature[:-2]).to_json())
    return bob


def _future_identity(keyed, tmp_path):
    bob, _ = issue_key(keyed[0], "r", "bob", keyed[4], now=NOW + 3600)
    return bob


def _unknown_key(keyed, tmp_path):
    return new_worker_key("r", "bob")


def _revoked(keyed, tmp_path):
    bucket, signer, alice = keyed[0], keyed[4], keyed[5]
    book = IdentityBook(bucket, "r", signer.public_hex)
    book.refresh()
    assert revoke_keys(bucket, book, "alice", signer, now=NOW) == [alice.public_hex]
    return alice


CASES = {
    "identity_forged": (_other_run_identity, "bob-a1b2c3"),
    "identity_run": (_wrong_run_identity, "bob-a1b2c3"),
    "identity_malformed": (_short_signature_identity, "bob-a1b2c3"),
    "identity_clock": (_future_identity, "bob-a1b2c3"),
    "identity_unknown": (_unknown_key, "bob-a1b2c3"),
    "revoked": (_revoked, "alice-a1b2c3"),
    "identity_worker": (lambda keyed, _: keyed[5], "carol-a1b2c3"),  # alice's key under carol's name
}


@pytest.mark.parametrize("reason", sorted(CASES))
def test_each_bad_identity_is_a_named_rejection_never_held_against_the_worker(keyed, tmp_path, reason):
    make, worker = CASES[reason]
    key = make(keyed, tmp_path)
    signed_put(keyed, key, worker=worker)
    gate = GateSpy()
    pool, stats = intake(keyed, gate)
    assert stats.rejected == {reason: 1} and stats.accepted == 0 and not pool.entries
    assert gate.seen == []


def test_unsigned_and_tampered_records_are_named_rejections(keyed):
    bucket, contract, task, codec, _, _ = keyed
    put(bucket, contract, task, codec, worker="alice-a1b2c3", seq=0)  # unsigned

    def flip(body):  # one logprob bit, after signing
        body[-200] ^= 1
        return body

    signed_put(keyed, seq=1, mutate=flip)
    gate = GateSpy()
    pool, stats = intake(keyed, gate)
    assert stats.rejected == {"unsigned": 1, "signature": 1} and not pool.entries and gate.seen == []


def test_a_signed_record_moved_to_another_key_is_refused_and_not_held_against_its_worker(keyed):
    bucket, contract, task, codec, signer, _ = keyed
    rk = signed_put(keyed, seq=0)
    data = bucket.get(rk)
    bucket.put_create(rollout_key("r", 2, "alice-a1b2c3", 0), data)  # another version: "version" if unsigned
    bucket.put_create(rollout_key("r", 1, "alice-a1b2c3", 7), data)  # another seq: "duplicate" if unsigned
    bucket.put_create(rollout_key("r", 1, "alice-ffffff", 0), data)  # another process: "key" if unsigned
    gate = GateSpy()
    book = IdentityBook(bucket, "r", signer.public_hex, clock=lambda: NOW)
    pool = RecordPool(bucket, contract, task, codec, staleness_bound=3, reuse_cap=2, gate=gate, identities=book)
    assert pool.refresh(2) == 1
    assert pool.drain_stats().rejected == {"signature": 3} and gate.seen == [("alice-a1b2c3", True)]


def test_with_worker_keys_quarantine_judges_the_keys_name_so_a_restart_does_not_escape_it(keyed):
    bucket, contract, task, codec, signer, alice = keyed

    for seq in (0, 1):  # signed records of alice's that fail validation: her own doing
        rk = put(bucket, contract, task, codec, worker="alice-aaaaaa", seq=seq)
        rec = RolloutRecord.decode(bucket.get(rk))
        rec.task_id = "other"
        bucket.delete(rk)
        bucket.put_create(rk, rec.encode(sign=alice.record_signer(rk)))
    signed_put(keyed, worker="alice-bbbbbb", seq=2)  # the same worker restarted: a new process id
    gate = Quarantine(enabled=True, disagreement=0.15, reject_rate=0.5, min_records=2, by_name=True)
    book = IdentityBook(bucket, "r", signer.public_hex, clock=lambda: NOW)
    pool = RecordPool(bucket, contract, task, codec, staleness_bound=3, reuse_cap=2, gate=gate, identities=book)
    assert pool.refresh(1) == 0 and gate.is_quarantined("alice-cccccc")
    assert pool.drain_stats().rejected == {"task": 2, "quarantined": 1}


def test_a_revocation_takes_effect_at_the_next_intake_and_drops_waiting_groups(keyed):
    bucket, contract, task, codec, signer, alice = keyed
    signed_put(keyed, seq=0)
    book = IdentityBook(bucket, "r", signer.public_hex, clock=lambda: NOW)
    pool = RecordPool(bucket, contract, task, codec, staleness_bound=3, reuse_cap=2, identities=book)
    assert pool.refresh(1) == 1
    revoke_keys(bucket, book, "alice", signer, now=NOW)
    signed_put(keyed, seq=1)
    assert pool.refresh(1) == 0
    assert not pool.entries and pool.drain_stats().rejected == {"revoked": 2}
    bucket.delete(revocation_key("r", alice.public_hex))  # deleting it does not undo it
    signed_put(keyed, seq=2)
    pool.refresh(1)
    assert not pool.entries and pool.drain_stats().rejected == {"revoked": 1}


def test_a_reissued_name_signs_again_while_its_revoked_key_stays_refused(keyed):
    bucket, _, _, _, signer, alice = keyed
    book = IdentityBook(bucket, "r", signer.public_hex)
    book.refresh()
    revoke_keys(bucket, book, "alice", signer, now=NOW)
    alice2, _ = issue_key(bucket, "r", "alice", signer, now=NOW)
    signed_put(keyed, alice, seq=0)
    signed_put(keyed, alice2, seq=1)
    pool, stats = intake(keyed)
    assert stats.accepted == 1 and stats.rejected == {"revoked": 1}
    assert next(iter(pool.entries.values())).signer == alice2.public_hex


def test_a_forged_or_misfiled_revocation_revokes_nothing(keyed, tmp_path):
    bucket, _, _, _, _, alice = keyed
    other = create_key(tmp_path / "keys" / "other.ed25519")
    forged = sign_statement(other, "revocation", "r", "alice", alice.public_hex, NOW)
    bucket.put_create(revocation_key("r", alice.public_hex), forged.to_json())
    bucket.put_create(revocation_key("r", "ab" * 32), b"{not json")
    signed_put(keyed)
    _, stats = intake(keyed)
    assert stats.accepted == 1 and not stats.rejected


def test_statements_parse_totally_and_refuse_by_name(keyed):
    signer, alice = keyed[4], keyed[5]
    good = sign_statement(signer, "identity", "r", "alice", alice.public_hex, NOW)
    assert Statement.parse(good.to_json()) == good
    good.check("r", signer.public_hex)
    edited = json.loads(good.to_json())
    edited["at"] = NOW - 1
    bads = [b"", b"[]", b"{}", b"x" * 5000, json.dumps({**edited, "kind": "other"}).encode(),
            json.dumps({**edited, "public_key": "AB" * 32}).encode(), json.dumps({**edited, "at": True}).encode()]
    for data in bads:
        with pytest.raises(ValueError) as e:
            Statement.parse(data)
        assert e.value.reason == "identity_malformed"  # type: ignore[attr-defined]
    with pytest.raises(ValueError) as e:
        Statement.parse(json.dumps(edited).encode()).check("r", signer.public_hex)
    assert e.value.reason == "identity_forged"  # type: ignore[attr-defined]


def test_a_worker_key_file_is_0600_and_refuses_another_run_or_junk(tmp_path):
    key = new_worker_key("r", "alice")
    path = tmp_path / "alice.key"
    write_worker_key(path, key)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    back = load_worker_key(path, "r")
    assert back.public_hex == key.public_hex and back.worker == "alice"
    with pytest.raises(FileExistsError):
        write_worker_key(path, key)
    with pytest.raises(RunKeyError, match="is for run 'r'"):
        load_worker_key(path, "r2")
    for junk in (b"", b"{}", json.dumps({**json.loads(path.read_text()), "private_key": "00" * 31}).encode()):
        (tmp_path / "junk.key").write_bytes(junk)
        with pytest.raises(RunKeyError, match="worker-key issue"):
            load_worker_key(tmp_path / "junk.key", "r")


def test_names_keys_and_process_ids():
    pub = "ab" * 32
    assert parse_identity_key("r", identity_key("r", "a.b-c", pub)).name == "a.b-c"  # type: ignore[union-attr]
    assert parse_revocation_key("r", revocation_key("r", pub)) == pub
    for key in (identity_key("r", "a", pub[:-2]), identity_key("r2", "a", pub), "runs/r/identities/a/b/" + pub):
        assert parse_identity_key("r", key) is None
    assert name_of("alice-a1b2c3") == "alice" and name_of("a-b-c0ffee") == "a-b" and name_of("alice") is None
    with pytest.raises(ValueError, match="worker name"):
        new_worker_key("r", "-bad")
    assert rollout_key("r", 1, "alice-a1b2c3", 0).endswith("alice-a1b2c3-00000000.rec")


@pytest.mark.parametrize(("setting", "url", "run_key", "want"), [
    ("auto", "s3://b", "ab" * 32, True), ("auto", "r2://b/p", "ab" * 32, True), ("auto", "s3://b", "", False),
    ("auto", "/tmp/b", "ab" * 32, False),
    ("required", "/tmp/b", "ab" * 32, True), ("off", "s3://b", "ab" * 32, False)])
def test_worker_keys_are_on_by_default_for_object_stores_and_off_is_logged(setting, url, run_key, want):
    lines: list[str] = []
    assert worker_keys_wanted(setting, url, "r", run_key, lines.append) is want
    assert len(lines) == 1 and (want or "anyone who can write the bucket" in lines[0])
    change = "worker_keys = off turns" if want else "worker_keys = required turns"
    assert f"worker_keys = {setting}" in lines[0] and change in lines[0]  # the setting, and how to change it


def test_required_worker_keys_without_a_run_key_is_refused_naming_the_fix():
    with pytest.raises(RunKeyError, match="sign_weights = true"):
        worker_keys_wanted("required", "s3://b", "r", "", lambda _: None)
