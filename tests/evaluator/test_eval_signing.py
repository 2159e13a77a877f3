"""``stoa eval`` and ``stoa export`` on a signed run: a forged pointer (a real chain written with bucket access,
without the run's key) is refused in one line; the trainer's own pointer is followed."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from stoa.bucket import Bucket, open_bucket
from stoa.cli import main
from stoa.contract import ModelSpec, RunContract, SamplingSpec, upload_model_files
from stoa.layout import anchor_prefix, contract_key, pointer_key, status_key
from stoa.models import model_fingerprint
from stoa.schemas.control import RunStatus
from stoa.weights.planes import state_from_f32
from stoa.weights.pointer import Pointer
from stoa.weights.publish import WeightPublisher
from stoa.weights.signing import create_key
from tests.evaluator.test_follow import eval_rows

RUN = "r"


def signed_run(bucket: Bucket, tiny_dir: Path, key: Path) -> tuple[WeightPublisher, dict]:
    """A signed hand-made run at v2; returns its publisher and the f32 base weights."""
    fp = model_fingerprint(tiny_dir)
    signer = create_key(key)
    contract = RunContract(run_id=RUN, model=ModelSpec(fp.architecture, fp.config_hash, fp.tokenizer_hash, 512),
                           n_samples=2, plane="bf16", task_id="toy", task_spec={}, reward_version="1",
                           sampling=SamplingSpec(max_new_tokens=4), created_at=time.time())
    upload_model_files(bucket, RUN, tiny_dir)
    bucket.put_create(contract_key(RUN), signer.sign_contract(contract).to_json())
    f32 = {k: v.astype(np.float32) for f in sorted(tiny_dir.glob("model*.safetensors"))
           for k, v in load_file(str(f)).items()}
    pub = WeightPublisher(bucket, RUN, "bf16", anchor_every=1000, signer=signer)
    for v in (1, 2):
        pub.publish(v, state_from_f32({k: a + 0.01 * v for k, a in f32.items()}, "bf16"))
    return pub, f32


def forge_v3(bucket: Bucket, f32: dict) -> None:
    """Someone with the bucket's credentials but not the key publishes v3 (anchor and pointer, a valid chain)."""
    attacker = WeightPublisher(bucket, RUN, "bf16", anchor_every=1000)
    attacker._pointer_read = True  # noqa: SLF001 - write over the trainer's pointer as a raw writer would
    attacker._pointer = Pointer.from_json(*bucket.get_with_etag(pointer_key(RUN)))  # noqa: SLF001
    attacker.publish(3, state_from_f32({k: -a for k, a in f32.items()}, "bf16"))


def test_eval_and_export_refuse_a_forged_pointer_and_follow_the_trainers(tmp_path, tiny_dir, capsys):
    url = str(tmp_path / "b")
    bucket = open_bucket(url)
    pub, f32 = signed_run(bucket, tiny_dir, tmp_path / "keys" / "run.ed25519")
    forge_v3(bucket, f32)
    args = ["eval", "--bucket", url, "--run", RUN, "--engine", "torch", "--eval-n", "2", "--threads", "1",
            "--log-dir", str(tmp_path / "logs")]
    assert main(args) == 10
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unsigned" in err[0], err
    assert eval_rows(bucket) == []
    out = tmp_path / "export"
    assert main(["export", "--bucket", url, "--run", RUN, str(out)]) == 8
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unsigned" in err[0] and not out.exists(), err
    pub.publish(3, state_from_f32({k: a + 0.03 for k, a in f32.items()}, "bf16"))  # replaces the forgery
    assert pub.forged_pointers == 1
    assert main(args) == 0
    assert [r["version"] for r in eval_rows(bucket)] == [3]
    assert main(["export", "--bucket", url, "--run", RUN, str(out)]) == 0
    # following to the end: v4 is reached through a target bound to the signed pointer by the hash chain (the
    # forger's anchor at v3 removed: the evaluator would refuse it there and pass over v4)
    bucket.delete_prefix(anchor_prefix(RUN, 3))
    for v in (4, 5):
        pub.publish(v, state_from_f32({k: a + 0.01 * v for k, a in f32.items()}, "bf16"))
    bucket.put(status_key(RUN), RunStatus("finished", 5, time.time(), time.time()).to_json())
    assert main([*args, "--follow", "--poll-seconds", "0.01"]) == 0
    assert sorted(r["version"] for r in eval_rows(bucket)) == [3, 4, 5]


def test_a_worker_follows_only_the_pinned_key(tmp_path, tiny_dir):
    import dataclasses

    import pytest

    from stoa.config import WorkerConfig
    from stoa.contract import RunKeyError
    from stoa.worker.loop import _set_up

    url = str(tmp_path / "b")
    bucket = open_bucket(url)
    pub, f32 = signed_run(bucket, tiny_dir, tmp_path / "keys" / "run.ed25519")
    wcfg = WorkerConfig(bucket=url, run=RUN, engine="torch", threads=1, poll_seconds=0.01, wait_seconds=5,
                        log_dir=str(tmp_path / "logs"))
    lines: list[str] = []
    worker = _set_up(wcfg.validate(), lines.append)
    assert worker.sync.run_key == pub.run_key and any("first use" in line for line in lines)
    assert worker.follower.step().version == 2
    forge_v3(bucket, f32)
    step = worker.follower.step()
    assert step.version == 2 and step.error is not None and step.error.reason == "unsigned"
    worker.metrics.close()
    other = create_key(tmp_path / "other").public_hex
    with pytest.raises(RunKeyError, match="--run-key-pub"):
        _set_up(dataclasses.replace(wcfg, run_key_pub=other).validate(), lines.append)
