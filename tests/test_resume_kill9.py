"""A trainer killed with SIGKILL and restarted with only --bucket and --run trains with the run's own settings."""

from __future__ import annotations

import signal
import tempfile

import pytest
import torch

from stoa.bucket import open_bucket
from stoa.trainer import checkpoint as ckpt
from tests.faults.conftest import procs  # noqa: F401 - the process-runner fixture
from tests.integration.conftest import train_rows, wait_for
from tests.integration.test_loop_local import worker_args

RUN = "k"
STEPS, GROUPS, LR = 6, 2, 1e-3
"""Not the defaults (0 = forever, 8, 1e-5): a restart that forgot them would show."""
ARGS = ["--model", "tiny", "--task", "toy", "--n-samples", "4", "--groups-per-step", str(GROUPS), "--lr", str(LR),
        "--steps", str(STEPS), "--max-new-tokens", "8", "--eval-n", "0", "--kl-beta", "0", "--poll-seconds", "0.2",
        "--max-wait-seconds", "120"]


def optimizer_lr(bucket, run: str) -> float:
    """The learning rate in the optimizer state of the run's checkpoint (what the trainer stepped with)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ref = ckpt.read_pointer(bucket, run)
    assert ref is not None
    with tempfile.TemporaryDirectory() as tmp:
        ckpt._download(bucket, run, ref, tmp)
        dcp_to_torch_save(tmp, f"{tmp}/full.pt")
        state = torch.load(f"{tmp}/full.pt", map_location="cpu", weights_only=True)
    return float(state["optim"]["param_groups"][0]["lr"])


@pytest.mark.slow
def test_a_bare_restart_after_kill_9_keeps_lr_groups_per_step_and_total_steps(procs, tmp_path):  # noqa: F811
    root = tmp_path / "bucket"
    metrics = root / "runs" / RUN / "metrics" / "trainer.jsonl"
    first = procs.start("t1", "trainer", "--bucket", str(root), "--run", RUN, *ARGS)
    procs.start("w0", *worker_args(str(root), RUN, "w0"))
    wait_for(lambda: len(train_rows(metrics)) >= 2, 180, "two trainer steps")
    first.send_signal(signal.SIGKILL)
    assert first.wait(timeout=30) == -signal.SIGKILL
    bucket = open_bucket(str(root))
    assert ckpt.read_pointer(bucket, RUN) is None  # no checkpoint yet: the restart's optimizer starts from its lr
    killed_at = len(train_rows(metrics))

    second = procs.start("t2", "trainer", "--bucket", str(root), "--run", RUN)
    assert second.wait(timeout=240) == 0, procs.log("t2")[-3000:]
    log = procs.log("t2")
    assert f"[trainer] run '{RUN}': resuming with its stored settings\n" in log
    assert ckpt.read_journal(bucket, RUN)["step"] == STEPS and f"done: the run is at step {STEPS}," in log
    after = train_rows(metrics)[killed_at:]
    assert after and all(len(r["rollout/keys"]) == GROUPS for r in after)
    assert ckpt.read_pointer(bucket, RUN).step == STEPS  # the final checkpoint, written as the run finished
    assert optimizer_lr(bucket, RUN) == LR
