"""The cold start: loss on action tokens only, learning on the tiny model, the stage before v1, resume rules."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from stoa.bucket import open_bucket
from stoa.config import TrainerConfig
from stoa.config.base import ConfigError
from stoa.rollouts.episode import ROLE_ACTION, ROLE_ECHO, ROLE_MASKED
from stoa.tasks.arithmetic import ArithmeticTask
from stoa.telemetry.metrics import read_bucket_metrics
from stoa.tokenize import TextCodec
from stoa.trainer.coldstart import SftRow, build_rows, cold_start_key, read_marker, sft_loss, sft_steps
from stoa.trainer.policy import Policy


@pytest.fixture(scope="module")
def policy(tiny_dir) -> Policy:
    torch.manual_seed(0)
    return Policy(tiny_dir, torch.device("cpu"))


def test_sft_loss_is_the_negative_logprob_of_action_tokens_only(policy):
    row = SftRow(np.array([5, 9, 11], np.int32), np.array([20, 21, 22, 23, 24], np.int32),
                 np.array([ROLE_ACTION, ROLE_MASKED, ROLE_ECHO, ROLE_ACTION, ROLE_ACTION], np.int8))
    with torch.no_grad():
        loss, n = sft_loss(policy, [row])
        ids = torch.tensor([[5, 9, 11, 20, 21, 22, 23, 24]])
        logp = torch.log_softmax(policy.model(ids).logits.float(), -1)[0]
        # token t after the prompt (3 tokens) is predicted at position 2 + t
        want = -sum(float(logp[2 + t, int(row.tokens[t])]) for t in (0, 3, 4))
    assert n == 3 and float(loss) == pytest.approx(want, rel=1e-5)
    # masked and echo tokens add nothing: scoring every token gives a larger sum
    every = row._replace(roles=np.full(5, ROLE_ACTION, np.int8))
    with torch.no_grad():
        assert float(sft_loss(policy, [every])[0]) > float(loss) + 1e-3


def test_loss_falls_over_a_few_steps_on_the_tiny_model(tiny_dir):
    torch.manual_seed(0)
    fresh = Policy(tiny_dir, torch.device("cpu"))
    task = ArithmeticTask()
    rows, _ = build_rows(task.demonstrations(8, np.random.default_rng(0)), task, TextCodec(tiny_dir), None, 16,
                         strict=True)
    figures = sft_steps(fresh, rows, steps=6, batch=8, micro_batch=3, lr=3e-3, grad_clip=1.0, seed=0)
    assert [f.step for f in figures] == list(range(1, 7))
    assert figures[-1].loss < 0.7 * figures[0].loss
    assert all(f.tokens == sum(len(r.tokens) for r in rows) for f in figures)


def cfg_of(url: str, **kw) -> TrainerConfig:
    base = dict(bucket=url, run="r", model="tiny", task="arithmetic", n_samples=2, eval_n=0, kl_beta=0.0,
                anchor_every=100, groups_per_step=2, staleness_bound=1, poll_seconds=0.01, metrics_flush_rows=1,
                log_dir="", cold_start="demos", cold_start_steps=3, cold_start_examples=8, cold_start_batch=4,
                max_new_tokens=8)
    return TrainerConfig(**{**base, **kw}).validate()


def start(cfg: TrainerConfig, lines: list[str]):
    from stoa.trainer.loop import _Trainer

    t = _Trainer(cfg, echo=lines.append)
    try:
        t.open_lifecycle()
        t.resume()
        t.metrics.close()
    finally:
        t.close()
    return t


def test_a_new_run_cold_starts_before_v1_and_a_resumed_run_never_redoes_it(tmp_path, tiny_dir, monkeypatch):
    from stoa.trainer.ranks import RankOps
    from stoa.weights.planes import state_to_f32

    url, lines = str(tmp_path / "b"), []
    t = start(cfg_of(url), lines)
    bucket = open_bucket(url)
    marker = read_marker(bucket, "r")
    assert marker is not None and marker["state"] == "done" and marker["steps"] == 3 and marker["source"] == "demos"
    rows = [r for r in read_bucket_metrics(bucket, "r") if "sft/loss" in r]
    assert [r["sft/step"] for r in rows] == [1, 2, 3] and all(r["sft/tokens"] > 0 for r in rows)
    assert not t.pool.entries  # demonstrations are never rollout records
    assert [x.split(":")[0] for x in lines if "cold start step" in x] == [f"[trainer] cold start step {i}/3"
                                                                          for i in (1, 2, 3)]
    stored = json.loads(bucket.get("runs/r/config.json"))["settings"]
    assert stored["cold_start"] == "demos" and stored["cold_start_steps"] == 3
    # v1 holds the cold-started weights, not the base model's
    assert t.publisher.published_state is not None
    v1 = state_to_f32(t.publisher.published_state, "bf16")
    base = Policy(tiny_dir, torch.device("cpu")).export_f32()
    assert sum(not np.array_equal(v1[k], _bf16(base[k])) for k in base) >= len(base) // 2

    def never(*_a, **_k):
        raise AssertionError("a resumed run ran the cold start again")
    monkeypatch.setattr(RankOps, "cold_start", never)
    lines.clear()
    start(cfg_of(url), lines)
    assert any("resumed run r at v1" in x for x in lines) and not any("cold start" in x for x in lines)


def _bf16(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(a)).to(torch.bfloat16).float().numpy()


def test_a_run_whose_cold_start_was_interrupted_is_refused_with_the_fix(tmp_path, stoa_cache, monkeypatch):
    from stoa.trainer.ranks import RankOps

    def killed(*_a, **_k):
        raise KeyboardInterrupt
    url = str(tmp_path / "b")
    monkeypatch.setattr(RankOps, "cold_start", killed)
    with pytest.raises(KeyboardInterrupt):
        start(cfg_of(url), [])
    monkeypatch.undo()
    assert (read_marker(open_bucket(url), "r") or {}).get("state") == "started"
    with pytest.raises(SystemExit, match=r"cold start did not finish .*start a new run .*delete that marker"):
        start(cfg_of(url), [])
    open_bucket(url).delete(cold_start_key("r"))  # the fix the line names
    start(cfg_of(url), [])
    assert (read_marker(open_bucket(url), "r") or {}).get("state") == "done"


def test_a_bad_demonstrations_file_trains_nothing_and_names_its_line(tmp_path, stoa_cache):
    path = tmp_path / "demos.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "What is 1 + 1?"},
                                    {"role": "assistant", "content": "2"}]})
    path.write_text(good + "\n" + good[:-3] + "\n")
    url = str(tmp_path / "b")
    with pytest.raises(SystemExit, match=rf"{path}:2: .*nothing was trained"):
        start(cfg_of(url, cold_start=str(path)), [])
    bucket = open_bucket(url)
    assert read_marker(bucket, "r") is None and not [r for r in read_bucket_metrics(bucket, "r") if "sft/loss" in r]


def test_cold_start_settings_are_checked_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match="cold_start_steps"):
        cfg_of(str(tmp_path), cold_start_steps=0)
    with pytest.raises(ConfigError, match="cold_start: 'demo' is not"):
        cfg_of(str(tmp_path), cold_start="demo")
    with pytest.raises(ConfigError, match="cold_start_lr"):
        cfg_of(str(tmp_path), cold_start_lr=-1.0)
