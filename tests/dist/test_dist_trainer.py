"""The trainer under torchrun (2 gloo ranks, CPU) with a worker over a local bucket: it trains and publishes
weights the worker verifies; killing one rank stops the job, and a single-process restart resumes from the
2-rank sharded checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import Procs, train_rows, wait_for
from tests.integration.test_loop_local import TRAIN_ARGS, worker_args


class TorchrunProcs(Procs):
    """``Procs`` that can also start ``stoa`` under torchrun."""

    def torchrun(self, name: str, nproc: int, *args: str) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "w")  # noqa: SIM115 - closed in stop_all
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "stoa", "--", *args]  # '--': torchrun would read a later --run as its --run-path
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.procs.append((name, p, log))
        return p


@pytest.fixture
def tprocs(tmp_path, stoa_cache):
    env = {**os.environ, "STOA_CACHE": str(stoa_cache), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    ps = TorchrunProcs(tmp_path, env)
    yield ps
    ps.stop_all()


def rank_pid(agent: subprocess.Popen, rank: int) -> int:
    """The pid of the torchrun agent's child that runs ``rank``."""
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
    for pid in children:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no child of {agent.pid} runs rank {rank}")


def settled(metrics: Path, quiet_s: float = 3.0) -> bool:
    """Whether the trainer took no step for ``quiet_s`` seconds."""
    import time

    before = len(train_rows(metrics))
    time.sleep(quiet_s)
    return len(train_rows(metrics)) == before


def pointer(bucket: Path, run: str) -> dict | None:
    path = bucket / "runs" / run / "trainer" / "checkpoint.json"
    return json.loads(path.read_text()) if path.exists() else None


@pytest.mark.slow
def test_killing_a_rank_stops_the_job_and_one_process_resumes_from_its_sharded_checkpoint(tprocs, tmp_path):
    bucket = tmp_path / "bucket"
    metrics = bucket / "runs" / "d" / "metrics" / "trainer.jsonl"
    args = ["trainer", "--bucket", str(bucket), "--run", "d", *TRAIN_ARGS, "--checkpoint-every", "2"]
    job = tprocs.torchrun("trainer2", 2, *args, "--steps", "0")
    worker = tprocs.start("w0", *worker_args(str(bucket), "d", "w0"))
    wait_for(lambda: (pointer(bucket, "d") or {}).get("step", 0) >= 4, 240, "a 2-rank checkpoint at step 4")
    # Rank 1 dies while rank 0 waits for records (the worker paused): rank 0 is in no collective, so only its
    # goodbye to the other ranks can tell it the job is broken.
    worker.send_signal(signal.SIGSTOP)
    wait_for(lambda: settled(metrics), 120, "the trainer to run out of records")
    os.kill(rank_pid(job, 1), signal.SIGKILL)
    assert job.wait(timeout=120) != 0  # the job stops (torchrun ends rank 0 too) and says it failed
    worker.send_signal(signal.SIGCONT)
    ckpt = pointer(bucket, "d")
    assert ckpt is not None and ckpt["world_size"] == 2
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(ckpt["files"])
    status = json.loads((bucket / "runs" / "d" / "status.json").read_text())
    assert status["state"] == "failed"  # not finished: workers keep waiting for the run to go on
    lease = json.loads((bucket / "runs" / "d" / "trainer" / "lease.json").read_text())
    assert lease["released"], lease  # the next trainer starts at once
    before = train_rows(metrics)
    journal = json.loads((bucket / "runs" / "d" / "trainer" / "journal.json").read_text())
    last_version = json.loads((bucket / "runs" / "d" / "weights" / "current.json").read_text())["version"]
    assert worker.poll() is None  # the worker waits for the next version
    # A plain single-process trainer resumes the run from the 2-rank sharded checkpoint.
    target = journal["step"]  # the run's steps, counted up to the one it was taking when killed
    solo = tprocs.start("trainer1", "trainer", "--bucket", str(bucket), "--run", "d", "--steps", str(target + 3),
                        "--max-wait-seconds", "120", "--poll-seconds", "0.2")
    assert solo.wait(timeout=300) == 0, tprocs.log("trainer1")
    log = tprocs.log("trainer1")
    resumed = [ln for ln in log.splitlines() if "resumed run d" in ln]
    assert resumed and f"checkpoint v{ckpt['version']}," in resumed[0], log[-2000:]
    rows = train_rows(metrics)
    versions = [r["version"] for r in rows]
    assert versions[len(before):] == list(range(last_version + 1, last_version + 4))  # the sequence continues
    assert pointer(bucket, "d")["world_size"] == 1  # and its own checkpoint replaces the 2-rank one
    worker.wait(timeout=120)  # the run finished: the worker, which verified every version it took, exits
    assert "finished" in tprocs.log("w0") and "rejected" not in tprocs.log("w0")


@pytest.mark.slow
def test_an_idle_fleet_longer_than_the_collective_timeout_does_not_fail_the_job(tprocs, tmp_path):
    """The other ranks wait in a broadcast while rank 0 waits for records; without rank 0's keep-alive they would
    time out (here after 10 s) and take the job down before any worker arrived."""
    import time

    bucket = tmp_path / "bucket"
    tprocs.env["STOA_DIST_TIMEOUT_S"] = "10"
    job = tprocs.torchrun("trainer2", 2, "trainer", "--bucket", str(bucket), "--run", "q", *TRAIN_ARGS,
                          "--steps", "2")
    current = bucket / "runs" / "q" / "weights" / "current.json"
    wait_for(current.exists, 240, "the 2-rank trainer to publish v1 and wait for records")
    time.sleep(25)  # two and a half timeouts with no worker
    assert job.poll() is None, tprocs.log("trainer2")[-3000:]
    tprocs.start("w0", *worker_args(str(bucket), "q", "w0"))
    assert job.wait(timeout=240) == 0, tprocs.log("trainer2")[-3000:]
    assert [r["step"] for r in train_rows(bucket / "runs" / "q" / "metrics" / "trainer.jsonl")] == [1, 2]
