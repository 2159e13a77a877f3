"""Base runs: a tiny run over a local bucket, built once, then copied into every cell's sandbox.

``toy`` (unsigned, the local default) and ``signed`` (``--sign-weights true``) train 2 steps of the toy task with
one worker and finish; ``gsm8k`` (task data from a local jsonl, uploaded by the trainer) and ``search`` (a BM25
index built and uploaded by the trainer) stop once their first weights are published.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from tests.hostile import runner
from tests.hostile.objects import RUN

STEPS = 2
"""Optimizer steps of the toy base runs; the trainer cell resumes them for one more."""
TRAIN_ARGS = ["--model", "tiny", "--n-samples", "2", "--groups-per-step", "2", "--max-new-tokens", "6",
              "--lr", "3e-2", "--eval-n", "0", "--kl-beta", "0", "--poll-seconds", "0.2",
              "--anchor-every", "100", "--staleness-bound", "1", "--status-seconds", "1", "--checkpoint-every", "1"]
"""The trainer settings of every base run (and of the trainer cell, which resumes it)."""
TASKS = {
    "toy": ["--task", "toy"],
    "signed": ["--task", "toy", "--sign-weights", "true"],
    "gsm8k": ["--task", "gsm8k:path={data}/train.jsonl"],
    "search": ["--task", "search:entities=40,max_turns=2,max_total_tokens=96,topk=1,max_doc_chars=80"],
}
PROBLEMS = [{"question": f"Tom has {i} apples and buys 4 more. How many apples?", "answer": f"#### {i + 4}"}
            for i in range(8)]


@dataclass(frozen=True)
class Base:
    """A built base run.

    Args:
        kind: a key of ``TASKS``.
        root: its directory: ``bucket/``, ``keys/`` (run key, keys trusted on first use), ``cache/``.
    """

    kind: str
    root: Path

    @property
    def bucket(self) -> Path:
        return self.root / "bucket"

    def trainer_argv(self, bucket: Path, steps: int, wait: float = 30.0) -> list[str]:
        """The trainer command line that resumes this run in ``bucket``, waiting ``wait`` seconds for records."""
        task = [a.format(data=self.root / "data") for a in TASKS[self.kind]]
        return ["trainer", "--bucket", str(bucket), "--run", RUN, *TRAIN_ARGS, *task, "--steps", str(steps),
                "--max-wait-seconds", str(wait)]


def worker_argv(bucket: Path, name: str, groups: int, wait: float = 20.0) -> list[str]:
    """A worker that uploads ``groups`` groups then exits."""
    return ["worker", "--bucket", str(bucket), "--run", RUN, "--name", name, "--engine", "torch", "--threads", "1",
            "--groups-in-flight", "1", "--max-groups", str(groups), "--poll-seconds", "0.2", "--wait-seconds",
            str(wait), "--status-seconds", "1"]


def base_env(root: Path, cache: Path, keys: Path, home: Path) -> dict[str, str]:
    """A client's whole environment: HOME, caches, temp and keys inside the given directories."""
    env = {k: os.environ[k] for k in ("PATH", "PYTHONPATH", "LANG", "LC_ALL") if k in os.environ}
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    return {**env, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "XDG_CONFIG_HOME": str(home / ".config"),
            "TMPDIR": str(home / "tmp"), "MPLCONFIGDIR": str(home / "mpl"), "HF_HOME": str(home / "hf"),
            "STOA_CACHE": str(cache), "STOA_KEY_DIR": str(keys), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def build(kind: str, root: Path, model_cache: Path) -> Base:
    """Build the base run ``kind`` under ``root`` (the tiny model copied from ``model_cache``); a ``root`` that
    already holds it is kept."""
    base = Base(kind, root)
    if (root / "built").is_file():  # kept from an earlier call with the same directory
        return base
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(model_cache, root / "cache")
    data = root / "data"
    data.mkdir(parents=True)
    (data / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    (data / "test.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS[:2]))
    env = base_env(root, root / "cache", root / "keys", root / "home")
    logs = root / "logs"
    finishes = kind in ("toy", "signed")
    trainer = runner.start(base.trainer_argv(base.bucket, STEPS if finishes else 0), env, root, logs, "trainer", 240)
    worker = None
    if finishes:
        _wait_for(base.bucket / "runs" / RUN / "weights" / "current.json", 120)
        worker = runner.start(worker_argv(base.bucket, "w0", 64, wait=60), env, root, logs, "worker", 240)
        outcome = trainer.wait()
    else:
        _wait_for(base.bucket / "runs" / RUN / "weights" / "current.json", 180)
        time.sleep(1.0)  # the status after the pointer
        trainer.stop()
        outcome = trainer.wait()
    if worker is not None:
        worker.stop()
    assert not finishes or outcome.code == 0, f"base run {kind}: {outcome.stderr[-2000:]}{outcome.stdout[-2000:]}"
    if finishes:  # a step's worth of unconsumed records at the current version, for the trainer cell
        make_live(base.bucket)
        extra = runner.run(worker_argv(base.bucket, "w1", 2), env, root, logs, "worker-extra", 120)
        assert outcome.code == 0 and len(list(base.bucket.glob("runs/*/rollouts/v*/w1-*.rec"))) == 2, extra.stderr
    (root / "built").write_text(kind)
    return base


def make_live(bucket: Path) -> None:
    """Mark the run running with a fresh heartbeat, as its trainer would between steps."""
    path = bucket / "runs" / RUN / "status.json"
    status = json.loads(path.read_bytes())
    now = time.time()
    status.update(state="running", heartbeat_at=now, updated_at=now)
    path.write_text(json.dumps(status, sort_keys=True))


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"timed out waiting for {path}"
        time.sleep(0.2)
