"""Trainer + worker processes over a local bucket, on a tiny model and the toy reward."""

from __future__ import annotations

import collections
import json
import signal
from pathlib import Path

import numpy as np
import pytest

from tests.integration.conftest import recompute_gap, train_rows, wait_for

TRAIN_ARGS = ["--model", "tiny", "--task", "toy", "--n-samples", "4", "--groups-per-step", "4",
              "--max-new-tokens", "8", "--lr", "3e-2", "--eval-n", "0", "--kl-beta", "0",
              "--max-wait-seconds", "120", "--poll-seconds", "0.2", "--anchor-every", "4"]


def worker_args(bucket: str, run: str, name: str) -> list[str]:
    return ["worker", "--bucket", bucket, "--run", run, "--name", name, "--engine", "torch", "--threads", "1",
            "--groups-in-flight", "2", "--poll-seconds", "0.2", "--wait-seconds", "120"]


def records_of(rollouts: Path, worker: str) -> set[str]:
    """Short keys (``v<version>/<id>-<seq>.rec``) of the records a worker labelled ``worker`` uploaded."""
    return {f"{p.parent.name}/{p.name}" for p in rollouts.glob(f"v*/{worker}-*.rec")}


def honest_intake(rows: list[dict]) -> None:
    """Honest workers: nothing rejected (any reason, quarantine included), no reward disagreement."""
    rejected = {k: v for r in rows for k, v in r.items() if k.startswith("rollout/rejected/") and v}
    assert rejected == {}
    assert sum(r["rollout/reward_mismatch"] for r in rows) == 0


@pytest.mark.slow
def test_reward_rises_and_a_killed_worker_does_not_stop_training(procs, tmp_path):
    bucket = str(tmp_path / "bucket")
    metrics = tmp_path / "bucket" / "runs" / "r1" / "metrics" / "trainer.jsonl"
    rollouts = tmp_path / "bucket" / "runs" / "r1" / "rollouts"
    trainer = procs.start("trainer", "trainer", "--bucket", bucket, "--run", "r1", "--steps", "20", *TRAIN_ARGS)
    w0 = procs.start("w0", *worker_args(bucket, "r1", "w0"))
    seen: set[str] = set()  # every w0 record ever listed: retention may delete them at any moment

    def w0_seen() -> set[str]:
        seen.update(records_of(rollouts, "w0"))
        return seen

    # w1 starts once w0 uploads: a w0 that starts late (a busy machine) would otherwise join only after w1
    # carried the run for many steps, and too few steps would be left after its records fall out of the window.
    wait_for(w0_seen, 180, "w0 uploading")
    procs.start("w1", *worker_args(bucket, "r1", "w1"))
    wait_for(lambda: len(train_rows(metrics)) >= 3 and w0_seen(), 180, "three steps, w0 uploading")
    assert w0.poll() is None  # alive and uploading until the kill
    w0.send_signal(signal.SIGKILL)  # a worker dies mid-run: the trainer keeps stepping
    assert w0.wait(timeout=30) == -signal.SIGKILL
    w0_records = set(w0_seen())
    assert trainer.wait(timeout=300) == 0, procs.log("trainer")
    rows = train_rows(metrics)
    assert [r["version"] for r in rows] == list(range(2, 22))
    # Nothing uploaded after the kill (retention may have deleted the stale ones since).
    assert records_of(rollouts, "w0") <= w0_records
    # w1 carried the run: once w0's newest records fell out of the staleness window (3), every step
    # trained on w1's records only.
    w0_newest = max(int(k[1:9]) for k in w0_records)
    after = [r for r in rows if r["version"] - 1 > w0_newest + 3]
    assert len(after) >= 8 and all(k.split("/")[1].startswith("w1-") for r in after for k in r["rollout/keys"])
    rewards = np.array([r["rollout/reward_mean"] for r in rows])
    assert rewards[-5:].mean() > rewards[:5].mean() + 0.05, rewards
    assert all(r["rollout/lag_max"] <= 3 for r in rows)
    uses = collections.Counter(k for r in rows for k in r["rollout/keys"])
    assert max(uses.values()) <= 2
    honest_intake(rows)


@pytest.mark.slow
def test_trainer_restart_continues_versions_without_exceeding_reuse_cap(procs, tmp_path):
    bucket = str(tmp_path / "bucket")
    metrics = tmp_path / "bucket" / "runs" / "r2" / "metrics" / "trainer.jsonl"
    args = ["trainer", "--bucket", bucket, "--run", "r2", *TRAIN_ARGS, "--reuse-cap", "2"]
    t1 = procs.start("trainer1", *args, "--steps", "0")
    procs.start("w0", *worker_args(bucket, "r2", "w0"))
    wait_for(lambda: len(train_rows(metrics)) >= 4, 180, "four trainer steps")
    t1.send_signal(signal.SIGKILL)
    t1.wait(timeout=30)
    before = train_rows(metrics)
    done = json.loads((tmp_path / "bucket" / "runs" / "r2" / "trainer" / "journal.json").read_text())["step"]
    t2 = procs.start("trainer2", *args, "--steps", str(done + 3))  # --steps is the run's total
    assert t2.wait(timeout=240) == 0, procs.log("trainer2")
    assert "resumed run r2" in procs.log("trainer2")
    rows = train_rows(metrics)
    versions = [r["version"] for r in rows]
    assert all(b > a for a, b in zip(versions, versions[1:], strict=False)), versions  # never repeats
    # The restarted trainer continues right after the newest published version (a kill between
    # publish and the metrics row can hide one version from the metrics, never reuse it).
    assert versions[len(before)] in (versions[len(before) - 1] + 1, versions[len(before) - 1] + 2), versions
    assert versions[len(before):] == list(range(versions[len(before)], versions[-1] + 1))
    assert len(rows) == len(before) + 3
    uses = collections.Counter(k for r in rows for k in r["rollout/keys"])
    assert max(uses.values()) <= 2, uses.most_common(3)
    honest_intake(rows)  # records used up before the kill are not rejections after the restart


def test_no_records_exits_5_naming_the_run_and_a_contract_mismatch_exits_3_naming_the_field(procs, tmp_path):
    bucket = str(tmp_path / "bucket")
    t = procs.start("t1", "trainer", "--bucket", bucket, "--run", "r3", *TRAIN_ARGS, "--steps", "1",
                    "--max-wait-seconds", "1")
    assert t.wait(timeout=120) == 5, procs.log("t1")  # no records for --max-wait-seconds, after writing the contract
    assert "no usable records" in procs.log("t1") and "run 'r3'" in procs.log("t1")
    t2 = procs.start("t2", "trainer", "--bucket", bucket, "--run", "r3", *TRAIN_ARGS, "--n-samples", "6")
    assert t2.wait(timeout=120) == 3
    assert "n_samples" in procs.log("t2")


@pytest.mark.slow
def test_fp32_worker_logprobs_equal_the_trainer_recompute_at_the_published_weights(procs, tmp_path, tiny_dir):
    """README: ``--dtype float32`` worker logprobs equal the trainer's recompute; lag-0 records of a fleet worker."""
    bucket, run = str(tmp_path / "bucket"), "lp"
    newest = tmp_path / "bucket" / "runs" / run / "rollouts" / "v00000003"
    t = procs.start("trainer", "trainer", "--bucket", bucket, "--run", run, *TRAIN_ARGS, "--steps", "2")
    # The worker must still sample at v3 after the trainer finished: it reads the run status (finished) rarely
    # and samples whatever the trainer wants.
    w = procs.start("w0", *worker_args(bucket, run, "w0"), "--dtype", "float32", "--seed", "3",
                    "--status-seconds", "60", "--no-backpressure")
    assert t.wait(timeout=240) == 0, procs.log("trainer")
    wait_for(lambda: len(list(newest.glob("*.rec"))) >= 4, 120, "records sampled at the final version v3")
    w.kill()
    w.wait(timeout=30)
    version, worst, tokens = recompute_gap(bucket, run, tiny_dir, newest)  # v3 through patches from the anchor
    assert version == 3
    print(f"\nfp32 worker vs trainer recompute at v3: max |d logprob| {worst:.2e} over {tokens} tokens")
    assert tokens >= 16 and worst <= 1e-5
