"""A trainer with worker keys, through its real intake and one real step: a valid worker's group trains; a forged
identity's, a revoked worker's and an unsigned record train nothing and are counted by name, with worker_keys =
required and with the default auto (which latches on)."""

from __future__ import annotations

import pytest
import xxhash

from stoa.bucket import open_bucket
from stoa.contract import RunKeyError
from stoa.identity import issue_key, new_worker_key, revoke_keys, sign_statement, worker_keys_latch
from stoa.identity.book import IdentityBook
from stoa.layout import identities_prefix, identity_key
from stoa.observe.audit import read_audit
from stoa.rollouts.records import RolloutRecord
from stoa.trainer.loop import _Trainer
from stoa.weights.signing import create_key, load_key
from tests.test_pool import put
from tests.trainer.test_trainer_signing import make_cfg


def _signed(bucket, t, worker: str, seq: int, key) -> str:
    """A record of ``worker`` at version 1, signed by ``key`` (None: unsigned); distinct content per seq."""
    rk = put(bucket, t.contract, t.task, t.codec, worker=worker, seq=seq)
    if key is not None:
        data = RolloutRecord.decode(bucket.get(rk)).encode(sign=key.record_signer(rk))
        bucket.delete(rk)
        bucket.put_create(rk, data)
    return rk


@pytest.mark.parametrize("setting", ["required", "auto"])
def test_forged_revoked_and_unsigned_records_train_nothing_while_a_valid_one_trains(tmp_path, stoa_cache, setting):
    url, path = str(tmp_path / "b"), tmp_path / "keys" / "r.ed25519"
    bucket, signer = open_bucket(url), create_key(path)  # the operator issues keys before the trainer starts
    alice, _ = issue_key(bucket, "r", "alice", signer)
    mallory, _ = issue_key(bucket, "r", "mallory", signer)
    eve = new_worker_key("r", "eve")  # her identity is signed by a key that is not the run's
    forged = sign_statement(create_key(tmp_path / "other.ed25519"), "identity", "r", "eve", eve.public_hex, 0)
    bucket.put_create(identity_key("r", "eve", eve.public_hex), forged.to_json())
    book = IdentityBook(bucket, "r", signer.public_hex)
    book.refresh()
    revoke_keys(bucket, book, "mallory", signer)
    lines: list[str] = []  # auto, the default: a local run holding identities requires them
    t = _Trainer(make_cfg(url, sign_weights="true", run_key=str(path), worker_keys=setting, groups_per_step=1,
                          steps=1, poll_seconds=0.05, max_wait_seconds=30), echo=lines.append)
    try:
        t.resume()
        assert any("must be signed by a worker key" in line for line in lines)
        good = _signed(bucket, t, "alice-a1b2c3", 0, alice)
        _signed(bucket, t, "mallory-a1b2c3", 1, mallory)
        _signed(bucket, t, "eve-a1b2c3", 2, eve)
        _signed(bucket, t, "alice-a1b2c3", 3, None)  # unsigned, under alice's name
        tampered = bytearray(bucket.get(_signed(bucket, t, "alice-a1b2c3", 4, alice)))
        tampered[-150] ^= 1  # a logprob byte after signing, the digest resealed: only the signature can tell
        body = bytes(tampered[:-16])
        bucket.put(good.replace("-00000000.rec", "-00000004.rec"), body + xxhash.xxh3_128_digest(body))
        assert t.pool.refresh(t.version) == 1 and t.pool.available() == 1
        assert t.pool.stats.rejected == {"revoked": 1, "identity_forged": 1, "unsigned": 1, "signature": 1}
        t.open_lifecycle()
        assert t.loop() == 1 and t.version == 2
        assert {u.key for u in t.pool.uses.values()} == {good}  # the only group any step took
        t.settle_publish()  # the step's provenance goes out after its pointer
        rows = read_audit(bucket, "r").rows  # stoa audit names the key that signed the trained group
        assert [r.signature for r in rows] == [f"signed {alice.public_hex[:16]}"]
    finally:
        t.close()


def test_a_trainer_requiring_worker_keys_in_a_run_without_a_run_key_refuses_to_start(tmp_path, stoa_cache):
    with pytest.raises(RunKeyError, match="worker_keys = required"):
        _Trainer(make_cfg(str(tmp_path / "b"), sign_weights="false", worker_keys="required"), echo=lambda *_: None)


def test_auto_latches_on_so_deleting_the_identities_cannot_turn_worker_keys_off(tmp_path, stoa_cache):
    url, path = str(tmp_path / "b"), tmp_path / "keys" / "r.ed25519"

    def start() -> bool:
        lines: list[str] = []
        t = _Trainer(make_cfg(url, sign_weights="true", run_key=str(path)), echo=lines.append)  # worker_keys auto
        t.close()
        [line] = [line for line in lines if "worker key" in line]
        assert "worker_keys" in line  # one line naming the setting (and how to change it)
        return t.pool.identities is not None

    assert not start()  # a local run without identities: off, like the quickstart
    bucket, latch = open_bucket(url), worker_keys_latch(path)
    issue_key(bucket, "r", "alice", load_key(path))
    assert start() and latch.is_file()  # an identity turns auto on, and the choice is latched beside the run key
    for info in list(bucket.list(identities_prefix("r"))):
        bucket.delete(info.key)
    assert start()  # the bucket's identities deleted: still on
    latch.unlink()
    assert not start()  # only the operator, on the trainer's machine, unlatches it
