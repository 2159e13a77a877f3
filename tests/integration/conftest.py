"""Fixtures for trainer + worker processes over a local bucket or a moto S3 endpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stoa.metrics import read_metrics


class Procs:
    """Starts ``python -m stoa ...`` processes with logs in files; kills leftovers at teardown."""

    def __init__(self, root: Path, env: dict[str, str]):
        self.root, self.env, self.procs = root, env, []

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "w")  # noqa: SIM115 - closed in stop_all
        p = subprocess.Popen([sys.executable, "-m", "stoa", *args], stdout=log, stderr=subprocess.STDOUT,
                             env=self.env)
        self.procs.append((name, p, log))
        return p

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text()

    def stop_all(self) -> None:
        for _, p, _ in self.procs:
            if p.poll() is None:
                p.kill()
        for _, p, log in self.procs:
            p.wait(timeout=30)
            log.close()


@pytest.fixture
def procs(tmp_path, stoa_cache):
    env = {**os.environ, "STOA_CACHE": str(stoa_cache), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    for k in ("DRL_RUN", "DRL_N_SAMPLES", "DRL_PULSE_PLANE", "STOA_RUN", "STOA_N_SAMPLES", "STOA_PLANE", "MODEL",
              "STOA_MODEL"):
        env.pop(k, None)
    ps = Procs(tmp_path, env)
    yield ps
    ps.stop_all()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.25):
    """Poll ``predicate`` until it returns a truthy value or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = predicate()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def train_rows(metrics_path: Path) -> list[dict]:
    """Rows of a trainer metrics file that describe optimizer steps."""
    return [r for r in read_metrics(metrics_path) if "train/loss" in r]


def recompute_gap(bucket_url: str, run: str, model_dir: Path, rollouts: Path) -> tuple[int, float, int]:
    """Rebuild the run's newest published weights as a worker does (anchor, then patches), score every record
    under ``rollouts`` with the trainer's policy at those weights, and return (version, max |recorded -
    recomputed logprob|, tokens). Every record must carry that version."""
    import numpy as np
    import torch

    from stoa.bucket import open_bucket
    from stoa.contract import RunContract
    from stoa.layout import contract_key
    from stoa.records import RolloutRecord
    from stoa.trainer.policy import Policy, pack
    from stoa.weights.planes import state_to_f32
    from stoa.weights.sync import WeightSync

    b = open_bucket(bucket_url)
    contract = RunContract.from_json(b.get(contract_key(run)))
    version, state = WeightSync(b, run, contract.plane).sync()
    policy = Policy(model_dir, torch.device("cpu"), temperature=contract.sampling.temperature, trainable=False)
    policy.load_f32(state_to_f32(state, contract.plane))
    worst, tokens = 0.0, 0
    for path in sorted(rollouts.glob("*.rec")):
        rec = RolloutRecord.decode(path.read_bytes())
        assert rec.policy_version == version
        t_max = max(s.tokens.size for s in rec.samples)
        batch = pack([rec.prompt_tokens] * len(rec.samples), [s.tokens for s in rec.samples], t_max, policy.device)
        with torch.no_grad():
            recomputed = policy.logprobs(batch).numpy()
        for i, s in enumerate(rec.samples):
            worst = max(worst, float(np.abs(recomputed[i, : s.tokens.size] - s.logprobs).max()))
            tokens += s.tokens.size
    return version, worst, tokens
