"""kill -9 of a signed run's trainer: the restart signs with the same key and its worker keeps following."""

from __future__ import annotations

import json
import signal

import pytest

from stoa.bucket import open_bucket
from stoa.weights.signing import load_key
from tests.integration.conftest import train_rows, wait_for
from tests.integration.test_loop_local import TRAIN_ARGS, worker_args
from tests.trainer.test_trainer_signing import signed_by


@pytest.mark.slow
def test_kill_9_and_resume_keeps_signing_and_the_worker_keeps_following(procs, tmp_path):
    bucket, key = str(tmp_path / "bucket"), tmp_path / "keys" / "r.ed25519"
    metrics = tmp_path / "bucket" / "runs" / "r" / "metrics" / "trainer.jsonl"
    args = ["trainer", "--bucket", bucket, "--run", "r", *TRAIN_ARGS, "--sign-weights", "true", "--run-key", str(key)]
    t1 = procs.start("trainer1", *args, "--steps", "0")
    procs.start("w0", *worker_args(bucket, "r", "w0"))
    wait_for(lambda: len(train_rows(metrics)) >= 2, 180, "two trainer steps")
    t1.send_signal(signal.SIGKILL)
    t1.wait(timeout=30)
    b = open_bucket(bucket)
    public = load_key(key).public_hex
    before = signed_by(b, public)
    done = json.loads((tmp_path / "bucket" / "runs" / "r" / "trainer" / "journal.json").read_text())["step"]
    t2 = procs.start("trainer2", *args, "--steps", str(done + 2))  # --steps is the run's total
    assert t2.wait(timeout=240) == 0, procs.log("trainer2")
    assert "resumed run r" in procs.log("trainer2")
    assert signed_by(b, public) > before  # the restart published, signed with the same key
    assert "refused" not in procs.log("w0") and "first use" in procs.log("w0")
    key.rename(tmp_path / "lost")
    t3 = procs.start("trainer3", *args, "--steps", "100")
    assert t3.wait(timeout=120) == 3
    assert f"{key} is missing" in procs.log("trainer3") and "Traceback" not in procs.log("trainer3")
