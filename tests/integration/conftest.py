"""Fixtures for trainer + worker processes over a local bucket or a moto S3 endpoint."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stoa.telemetry.metrics import read_metrics


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


def recompute_gap(bucket_url: str, run: str, model_dir: Path, rollouts: Path,
                  route_margin: float = 0.0, quantile: float = 1.0) -> tuple[int, float, int]:
    """Rebuild the run's newest published weights as a worker does (anchor, then patches), score every record
    under ``rollouts`` with the trainer's policy at those weights, and return (version, max |recorded -
    recomputed logprob|, tokens compared). Every record must carry that version.

    ``route_margin`` > 0 (MoE models): a token from the first position where some router's k-th and (k+1)-th
    scores lie closer than this on, is left out. Two engines' router inputs differ by rounding, so at such a
    near-tie each can pick another expert honestly, and every later token attends to that position. Leaving
    out more than half of the tokens fails: that is no near-tie but another model.

    ``quantile`` < 1 returns that quantile of the per-token gaps instead of their maximum."""
    import numpy as np
    import torch

    from stoa.bucket import open_bucket
    from stoa.contract import RunContract
    from stoa.engines.torch_scoring import pack_tensors
    from stoa.layout import contract_key
    from stoa.rollouts.records import RolloutRecord
    from stoa.trainer.policy import Policy
    from stoa.weights.planes import state_to_f32
    from stoa.weights.sync import WeightSync

    b = open_bucket(bucket_url)
    contract = RunContract.from_json(b.get(contract_key(run)))
    version, state = WeightSync(b, run, contract.plane).sync()
    policy = Policy(model_dir, torch.device("cpu"), temperature=contract.sampling.temperature, trainable=False)
    policy.load_f32(state_to_f32(state, contract.plane))
    gaps: list[np.ndarray] = []
    tokens, total = 0, 0
    for path in sorted(rollouts.glob("*.rec")):
        rec = RolloutRecord.decode(path.read_bytes())
        assert rec.policy_version == version
        t_max = max(s.tokens.size for s in rec.samples)
        batch = pack_tensors([rec.prompt_tokens] * len(rec.samples), [s.tokens for s in rec.samples], t_max,
                             policy.device)
        with torch.no_grad(), router_margins(policy.model) as margins:
            recomputed = policy.logprobs(batch).numpy()
        for i, s in enumerate(rec.samples):
            n = s.tokens.size
            if route_margin > 0 and margins:
                rows = [m.reshape(len(rec.samples), -1)[i] for m in margins]
                tie = np.flatnonzero(np.min(rows, axis=0) < route_margin)
                first = len(rec.prompt_tokens) - 1  # the logit row that scores the first completion token
                n = min(n, max(0, int(tie[0]) - first)) if tie.size else n
            total += s.tokens.size
            if n:
                gaps.append(np.abs(recomputed[i, :n] - s.logprobs[:n]))
            tokens += n
    assert tokens >= 0.5 * total, f"{total - tokens} of {total} tokens follow a router near-tie"
    worst = float(np.quantile(np.concatenate(gaps), quantile)) if gaps else 0.0
    return version, worst, tokens


@contextlib.contextmanager
def router_margins(model: Any) -> Iterator[list[Any]]:
    """Hook every MoE router (transformers' ``*TopKRouter``); yields a list that gets, per router call, the
    flat [batch x positions] gap between the k-th and (k+1)-th routing scores (softmax routers: logits; sigmoid
    routers with an expert bias: sigmoid + bias, the score they select by)."""
    import torch

    margins: list[Any] = []

    def hook(module: Any, args: Any, kwargs: Any, output: Any) -> None:
        logits = output[0].float()
        bias = kwargs.get("expert_bias", args[1] if len(args) > 1 else None)
        score = logits.sigmoid() + bias if getattr(module, "use_expert_bias", False) and bias is not None else logits
        top = torch.topk(score, module.top_k + 1, dim=-1).values
        margins.append((top[..., -2] - top[..., -1]).reshape(-1).numpy())  # [batch x positions], row-major

    mods = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in mods]
    try:
        yield margins
    finally:
        for h in handles:
            h.remove()
