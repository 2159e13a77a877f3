"""A trainer killed with SIGKILL and restarted with only --bucket and --run trains with the run's own settings; one
killed while a checkpoint writes in the background resumes from the previous checkpoint."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

from stoa.bucket import ObjectNotFound, open_bucket
from stoa.layout import checkpoint_files_prefix
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


def journal_step(bucket) -> int:
    journal = ckpt.read_journal(bucket, RUN)
    assert journal is not None
    return int(journal["step"])


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
    assert journal_step(bucket) == STEPS and f"done: the run is at step {STEPS}," in log
    after = train_rows(metrics)[killed_at:]
    assert after and all(len(r["rollout/keys"]) == GROUPS for r in after)
    final = ckpt.read_pointer(bucket, RUN)
    assert final is not None and final.step == STEPS  # the final checkpoint, written as the run finished
    assert optimizer_lr(bucket, RUN) == LR


SLOW_WRITE = '''
import pathlib, sys, time
from stoa.trainer import checkpoint as ck

MARK = pathlib.Path(sys.argv.pop(1))
real = ck.write_staged


class Slow:
    """The bucket, but the checkpoint's first file upload never returns (the trainer is killed meanwhile)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_file(self, key, path, **kw):
        self.inner.put_file(key, path, **kw)
        MARK.write_text(key)  # one file of this checkpoint is in the bucket, its pointer is not
        time.sleep(3600)


def slow_from_step_2(bucket, run_id, staged, echo=print, before_pointer=None):
    return real(Slow(bucket) if staged.step >= 2 else bucket, run_id, staged, echo, before_pointer)


ck.write_staged = slow_from_step_2
from stoa.cli import main
sys.exit(main(sys.argv[1:]))
'''
"""``python -c SLOW_WRITE MARK trainer ...``: a trainer whose checkpoints from step 2 on hang in the background."""


def published_version(bucket, run: str) -> int:
    from stoa.layout import pointer_key

    try:
        return int(json.loads(bucket.get(pointer_key(run)))["version"])
    except ObjectNotFound:
        return 0


@pytest.mark.slow
def test_a_kill_9_during_a_background_checkpoint_write_resumes_from_the_previous_one(procs, tmp_path):  # noqa: F811
    root, mark = tmp_path / "bucket", tmp_path / "writing"
    log = open(tmp_path / "t1.log", "w")  # noqa: SIM115 - closed by procs.stop_all
    first = subprocess.Popen([sys.executable, "-c", SLOW_WRITE, str(mark), "trainer", "--bucket", str(root), "--run",
                              RUN, *ARGS, "--checkpoint-every", "1"], stdout=log, stderr=subprocess.STDOUT,
                             env=procs.env)
    procs.procs.append(("t1", first, log))
    procs.start("w0", *worker_args(str(root), RUN, "w0"))
    bucket = open_bucket(str(root))
    wait_for(mark.exists, 180, "the step-2 checkpoint's first file")
    # Step 3 trains meanwhile: its journal and v4 go out, then its checkpoint waits for step 2's write.
    wait_for(lambda: published_version(bucket, RUN) >= 4, 120, "v4 published while the write hangs")
    first.send_signal(signal.SIGKILL)
    assert first.wait(timeout=30) == -signal.SIGKILL
    ref = ckpt.read_pointer(bucket, RUN)
    assert ref is not None and (ref.version, ref.step) == (2, 1)  # the previous checkpoint is still the one named
    half = mark.read_text().split("/")[-2]
    assert half != ref.tag and any(bucket.list(checkpoint_files_prefix(RUN, half)))  # half-written, never named
    acked_version, acked_step = published_version(bucket, RUN), journal_step(bucket)
    assert (acked_version, acked_step) == (4, 3)

    second = procs.start("t2", "trainer", "--bucket", str(root), "--run", RUN)
    assert second.wait(timeout=240) == 0, procs.log("t2")[-3000:]
    out = procs.log("t2")
    assert f"checkpoint v2 is behind the published v{acked_version}" in out  # nothing acknowledged is redone
    assert f"resumed run {RUN} at v{acked_version} (checkpoint v2, step {acked_step})" in out
    last = ckpt.read_pointer(bucket, RUN)
    assert last is not None and (last.step, last.version) == (STEPS, STEPS + 1)  # one version per step, none lost
    assert not any(bucket.list(checkpoint_files_prefix(RUN, half)))  # collected once a newer pointer was in
