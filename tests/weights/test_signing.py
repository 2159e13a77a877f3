"""The run's key: only the trainer's signed pointer moves a worker, the evaluator or an export.

A forger here has full bucket access (writes real patches and anchors that chain by hash to the pointer it
writes) but not the trainer's private key.
"""

from __future__ import annotations

import dataclasses
import json
import stat

import numpy as np
import pytest

from stoa.bucket import open_bucket
from stoa.contract import ContractMismatch, ModelSpec, RunContract, RunKeyError, SamplingSpec
from stoa.layout import contract_key, pointer_key
from stoa.weights.errors import SyncError
from stoa.weights.follow import WeightFollower
from stoa.weights.pointer import Pointer
from stoa.weights.publish import WeightPublisher
from stoa.weights.signing import (
    create_key,
    load_key,
    signing_wanted,
    trainer_signer,
    trusted_run_key,
)
from stoa.weights.sync import WeightSync

RUN = "r"


def state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"a.weight": rng.integers(0, 2**16, (32, 8), dtype=np.uint64).astype(np.uint16),
            "b.weight": rng.integers(0, 2**16, (64,), dtype=np.uint64).astype(np.uint16)}


def contract(**kw) -> RunContract:
    base = dict(run_id=RUN, model=ModelSpec("llama", "c" * 8, "t" * 8, 100, eos_token_ids=(2,)), n_samples=2,
                plane="bf16", task_id="toy", task_spec={"k": 1}, reward_version="1", sampling=SamplingSpec(),
                created_at=1.5)
    return RunContract(**{**base, **kw})


@pytest.fixture()
def signed(tmp_path):
    """A signed run in a local bucket: the trainer's key, its publisher at v2, and the key's other copy."""
    bucket = open_bucket(str(tmp_path / "b"))
    signer = create_key(tmp_path / "keys" / "run.ed25519")
    pub = WeightPublisher(bucket, RUN, "bf16", anchor_every=100, signer=signer)
    pub.publish(1, state(1))
    pub.publish(2, state(2))
    return bucket, signer, pub


def forge(bucket, version: int, weights, *, sign_with=None, as_patch: bool = True) -> Pointer:
    """What a holder of bucket credentials without the key can do: a real patch and an unsigned (or
    otherwise signed) pointer whose state hash chains to it."""
    attacker = WeightPublisher(bucket, RUN, "bf16", anchor_every=100, signer=sign_with)
    attacker._pointer_read = True  # noqa: SLF001 - write over the trainer's pointer as a raw bucket writer would
    attacker._pointer = Pointer.from_json(*bucket.get_with_etag(pointer_key(RUN)))  # noqa: SLF001
    if as_patch:  # a patch from the current weights (else a full anchor)
        attacker._prev, attacker._prev_version = WeightSync(bucket, RUN, "bf16").sync()[1], version - 1  # noqa: SLF001
    attacker.publish(version, weights)
    return Pointer.from_json(bucket.get(pointer_key(RUN)))


def test_the_key_file_is_private_and_reloads_to_the_same_key(tmp_path):
    signer = create_key(tmp_path / "k" / "run.ed25519")
    assert stat.S_IMODE((tmp_path / "k" / "run.ed25519").stat().st_mode) == 0o600
    assert load_key(signer.path).public_hex == signer.public_hex and len(signer.public_hex) == 64


def test_the_trainers_own_pointer_is_followed(signed):
    bucket, signer, pub = signed
    sync = WeightSync(bucket, RUN, "bf16", run_key=signer.public_hex)
    version, got = sync.sync()
    assert version == 2 and all(np.array_equal(got[k], state(2)[k]) for k in got)
    assert len(Pointer.from_json(bucket.get(pointer_key(RUN))).signature) == 128


@pytest.mark.parametrize("other_key", [False, True])
def test_a_forged_pointer_with_a_valid_chain_is_never_followed(signed, tmp_path, other_key):
    bucket, signer, pub = signed
    worker = WeightSync(bucket, RUN, "bf16", run_key=signer.public_hex)
    follower = WeightFollower(worker, staleness_bound=3, base_delay_s=0.0)
    assert follower.step().version == 2
    forged = forge(bucket, 3, state(99), sign_with=create_key(tmp_path / "evil.key") if other_key else None)
    # the chain itself is valid: a worker of an unsigned run would follow it
    assert WeightSync(bucket, RUN, "bf16").sync()[0] == 3 and forged.version == 3
    step = follower.step()
    assert step.version == 2 and step.adopted is None
    assert step.error is not None and step.error.reason == ("bad_signature" if other_key else "unsigned")
    assert [r.reason for r in step.refusals] == [step.error.reason]
    with pytest.raises(SyncError) as e:
        WeightSync(bucket, RUN, "bf16", run_key=signer.public_hex).sync()
    assert e.value.reason == step.error.reason
    # the trainer's next version replaces the forgery; the worker follows it
    pub.publish(3, state(3))
    assert pub.forged_pointers == 1
    follower._next_try = 0.0  # noqa: SLF001 - skip the backoff
    step = follower.step()
    assert step.version == 3 and all(np.array_equal(worker.state[k], state(3)[k]) for k in worker.state)


def test_a_signature_over_other_bytes_or_of_the_wrong_length_is_refused_by_name(signed):
    bucket, signer, _ = signed
    good = Pointer.from_json(bucket.get(pointer_key(RUN)))
    cases = {
        "bad_signature": dataclasses.replace(good, version=good.version + 1),  # signed bytes changed
        "malformed_signature": dataclasses.replace(good, signature=good.signature[:-2]),
        "unsigned": dataclasses.replace(good, signature=""),
    }
    for reason, p in cases.items():
        with pytest.raises(SyncError) as e:
            Pointer.from_json(p.to_json()).check_signature(signer.public_hex)
        assert e.value.reason == reason
    for junk in ("Z" * 128, "00" * 64, good.signature.upper()):
        with pytest.raises(SyncError) as e:
            dataclasses.replace(good, signature=junk).check_signature(signer.public_hex)
        assert e.value.reason in ("malformed_signature", "bad_signature")


def test_the_trainer_refuses_to_resume_from_a_forged_pointer(signed):
    bucket, signer, _ = signed
    forge(bucket, 3, state(99))
    restarted = WeightPublisher(bucket, RUN, "bf16", anchor_every=100, signer=signer)
    with pytest.raises(RunKeyError, match="not signed by the run's key") as e:
        restarted.resume()
    assert "\n" not in str(e.value) and pointer_key(RUN) in str(e.value)


def test_retention_is_not_steered_by_a_forged_pointer(signed):
    bucket, signer, pub = signed
    forge(bucket, 500, state(99), as_patch=False)  # followed, gc would keep only the forged anchor v500
    info = pub.gc(keep_versions=0)
    assert info.kept_anchor == 1 and info.deleted_anchors == [] and info.deleted_patches == []
    assert WeightSync(bucket, RUN, "bf16", run_key=signer.public_hex).newest_verified(pub.pointer)[0] == 2


def test_a_signed_contract_verifies_and_an_unsigned_one_is_written_as_before(tmp_path):
    plain = contract()
    assert b"run_key" not in plain.to_json() and RunContract.from_json(plain.to_json()) == plain
    signer = create_key(tmp_path / "k")
    c = signer.sign_contract(plain)
    back = RunContract.from_json(c.to_json())
    assert back.run_key == signer.public_hex and back == c
    assert c.fingerprint() != plain.fingerprint() and c.mismatches(dataclasses.replace(c, signature="")) == []


@pytest.mark.parametrize("tamper", ["swap_key", "drop_signature", "edit_field", "signature_only"])
def test_a_tampered_contract_is_a_named_refusal(tmp_path, tamper):
    signer, other = create_key(tmp_path / "k"), create_key(tmp_path / "o")
    d = json.loads(signer.sign_contract(contract()).to_json())
    if tamper == "swap_key":
        d["run_key"] = other.public_hex
    elif tamper == "drop_signature":
        d["signature"] = ""
    elif tamper == "edit_field":
        d["n_samples"] = 64
    else:
        d["run_key"] = ""
    with pytest.raises(RunKeyError) as e:
        RunContract.from_json(json.dumps(d).encode())
    assert e.value.fields == ["run_key"] and "\n" not in str(e.value)


def test_a_re_signed_contract_with_a_swapped_key_is_refused_when_pinned_or_seen_before(tmp_path):
    signer, evil = create_key(tmp_path / "k"), create_key(tmp_path / "o")
    lines: list[str] = []
    url = "s3://b/p"
    assert trusted_run_key(signer.public_hex, url, "pin1", echo=lines.append) == signer.public_hex  # first use
    assert trusted_run_key(signer.public_hex, url, "pin1", echo=lines.append) == signer.public_hex
    assert sum("first use" in line for line in lines) == 1
    swapped = evil.sign_contract(contract(run_id="pin1"))  # self-consistent, but not the run's key
    RunContract.from_json(swapped.to_json())
    for run_key in (evil.public_hex, ""):
        with pytest.raises(RunKeyError):
            trusted_run_key(run_key, url, "pin1", echo=lines.append)
    with pytest.raises(RunKeyError):  # pinned on the command line or join card
        trusted_run_key(evil.public_hex, url, "pin2", pinned=signer.public_hex, echo=lines.append)
    with pytest.raises(ContractMismatch):
        trusted_run_key(signer.public_hex, url, "pin3", pinned="not-a-key", echo=lines.append)
    assert trusted_run_key("", url, "plain", echo=lines.append) == ""
    assert any("unsigned weights" in line for line in lines)


def test_the_trainers_key_is_created_for_a_new_signed_run_and_required_to_resume(tmp_path):
    bucket = open_bucket(str(tmp_path / "b"))
    path = tmp_path / "keys" / "r.ed25519"
    lines: list[str] = []
    assert trainer_signer(bucket, bucket.url, RUN, "false", str(path), lines.append) is None
    assert not path.exists() and "unsigned" in lines[-1]
    signer = trainer_signer(bucket, bucket.url, RUN, "true", str(path), lines.append)
    assert signer is not None and path.is_file()
    bucket.put_create(contract_key(RUN), signer.sign_contract(contract()).to_json())
    again = trainer_signer(bucket, bucket.url, RUN, "false", str(path), lines.append)  # the run decides
    assert again is not None and again.public_hex == signer.public_hex
    create_key(tmp_path / "other")
    with pytest.raises(RunKeyError, match="set run_key"):
        trainer_signer(bucket, bucket.url, RUN, "true", str(tmp_path / "other"), lines.append)
    path.unlink()
    with pytest.raises(RunKeyError, match=f"{path} is missing"):
        trainer_signer(bucket, bucket.url, RUN, "true", str(path), lines.append)
    assert [o.key for o in bucket.list("")] == [contract_key(RUN)]  # the private key never enters the bucket


@pytest.mark.parametrize(("setting", "url", "want"), [
    ("auto", "s3://b/p", True), ("auto", "r2://b/p", True), ("auto", "/tmp/runs", False),
    ("auto", "file:///tmp/runs", False), ("True", "/tmp/runs", True), ("false", "s3://b", False),
])
def test_signing_is_on_by_default_for_object_stores_only(setting, url, want):
    assert signing_wanted(setting, url) is want


def test_an_old_signed_pointer_put_back_is_refused_as_a_rollback(signed):
    bucket, signer, pub = signed
    old = bucket.get(pointer_key(RUN))
    pub.publish(3, state(3))
    worker = WeightSync(bucket, RUN, "bf16", run_key=signer.public_hex)
    follower = WeightFollower(worker, staleness_bound=3, base_delay_s=0.0)
    assert follower.step().version == 3
    bucket.put(pointer_key(RUN), old)  # genuine, signed, but v2
    step = follower.step()
    assert step.version == 3 and step.error is not None and step.error.reason == "rollback"


def test_malformed_key_inputs_are_one_line_with_their_exit_code(tmp_path, capsys):
    from stoa.cli import main
    from stoa.config import TrainerConfig
    from stoa.config.base import ConfigError

    with pytest.raises(ConfigError, match="sign_weights"):
        TrainerConfig(sign_weights="maybe").validate()
    (tmp_path / "junk.key").write_text("not a key")
    with pytest.raises(RunKeyError, match="not a readable Ed25519 private key"):
        load_key(tmp_path / "junk.key")
    bucket = open_bucket(str(tmp_path / "b"))
    bucket.put_create(contract_key(RUN), create_key(tmp_path / "k").sign_contract(contract()).to_json())
    before = sorted(o.key for o in bucket.list(""))
    for pin, code in (("zz" * 32, 3), ("ab" * 32, 3)):  # malformed, then another key
        assert main(["worker", "--bucket", str(tmp_path / "b"), "--run", RUN, "--run-key-pub", pin,
                     "--wait-seconds", "1"]) == code
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "run_key" in err[0], err
    assert main(["trainer", "--bucket", str(tmp_path / "b"), "--run", "other", "--sign-weights", "maybe"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert sorted(o.key for o in bucket.list("")) == before
