"""A signed run's trainer: it creates the key with the run, signs every version, and resumes only with that key."""

from __future__ import annotations

import pytest

from stoa.bucket import open_bucket
from stoa.config import TrainerConfig
from stoa.contract import RunContract, RunKeyError
from stoa.layout import contract_key, pointer_key
from stoa.trainer.loop import _Trainer
from stoa.trainer.setup import model_from_bucket
from stoa.weights.errors import SyncError
from stoa.weights.pointer import Pointer
from stoa.weights.signing import load_key
from stoa.weights.sync import WeightSync
from tests.weights.test_signing import forge, state


def make_cfg(bucket: str, **kw) -> TrainerConfig:
    base = dict(bucket=bucket, run="r", model="tiny", task="toy", n_samples=2, eval_n=0, kl_beta=0.0,
                anchor_every=100)
    return TrainerConfig(**{**base, **kw}).validate()


def signed_by(bucket, public_hex: str) -> int:
    """The pointer's version, after checking it carries ``public_hex``'s signature."""
    return Pointer.from_json(bucket.get(pointer_key("r"))).check_signature(public_hex).version


def test_a_restarted_trainer_signs_with_the_same_key_and_refuses_without_it(tmp_path, stoa_cache):
    url, key = str(tmp_path / "b"), tmp_path / "keys" / "r.ed25519"
    lines: list[str] = []
    t1 = _Trainer(make_cfg(url, sign_weights="true", run_key=str(key)), echo=lines.append)
    t1.resume()
    t1.publish(2)
    t1.close()
    bucket, public = open_bucket(url), load_key(key).public_hex
    contract = RunContract.from_json(bucket.get(contract_key("r")))
    assert contract.run_key == public and signed_by(bucket, public) == 2
    assert any(public in line for line in lines)
    t2 = _Trainer(make_cfg(url, run_key=str(key)), echo=lambda *_: None)  # the run decides: still signed
    t2.resume()
    t2.publish(3)
    t2.close()
    genuine = bucket.get(pointer_key("r"))
    assert signed_by(bucket, public) == 3
    assert WeightSync(bucket, "r", "bf16", run_key=contract.run_key).sync()[0] == 3
    forge(bucket, 4, state(4), as_patch=False)  # a forged pointer: neither the model rebuild nor a restart uses it
    with pytest.raises(SyncError) as e:
        model_from_bucket(bucket, "r", "bf16", tmp_path / "rebuilt", run_key=contract.run_key)
    assert e.value.reason == "unsigned" and not (tmp_path / "rebuilt" / "model.safetensors").exists()
    t3 = _Trainer(make_cfg(url, run_key=str(key)), echo=lambda *_: None)
    with pytest.raises(RunKeyError, match="not signed by the run's key"):
        t3.resume()
    t3.close()
    bucket.put(pointer_key("r"), Pointer(**{**vars(Pointer.from_json(genuine)), "etag": None}).to_json())
    key.rename(tmp_path / "elsewhere")
    with pytest.raises(RunKeyError, match=f"{key} is missing"):
        _Trainer(make_cfg(url, run_key=str(key)), echo=lambda *_: None)
    _Trainer(make_cfg(url, run_key=str(tmp_path / "elsewhere")), echo=lambda *_: None).close()  # lease released


def test_a_local_run_without_keys_stays_unsigned_and_says_so(tmp_path, stoa_cache):
    lines: list[str] = []
    t = _Trainer(make_cfg(str(tmp_path / "b")), echo=lines.append)  # sign_weights auto: off for a directory
    t.resume()
    t.close()
    bucket = open_bucket(str(tmp_path / "b"))
    assert RunContract.from_json(bucket.get(contract_key("r"))).run_key == ""
    assert Pointer.from_json(bucket.get(pointer_key("r"))).signature == ""
    assert sum("weights unsigned" in line for line in lines) == 1
