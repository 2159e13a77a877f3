"""cold_start = "rft": only the policy's correct samples are kept, exactly as sampled; none correct refuses
before anything trains; the trainer records kept/tried; rank 0's engine holds the current weights."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from stoa.bucket import open_bucket
from stoa.engines.base import Completion, GenStats
from stoa.engines.factory import engine_from_model
from stoa.envs.base import episode_text
from stoa.episodes.demo_rows import build_rows
from stoa.episodes.driver import Episode
from stoa.episodes.rft import rejection_sample
from stoa.rollouts.episode import ROLE_ACTION
from stoa.tasks.arithmetic import ArithmeticTask
from stoa.tasks.demos import Demo
from stoa.tasks.multiturn import LocalTools
from stoa.tasks.walk import WalkTask
from stoa.telemetry.metrics import read_bucket_metrics
from stoa.tokenize import TextCodec
from stoa.trainer.coldstart import read_marker, sampling_engine
from stoa.trainer.policy import Policy


@pytest.fixture(scope="module")
def codec(tiny_dir) -> TextCodec:
    return TextCodec(tiny_dir)


def plan(k: int, j: int) -> bool:
    """Whether sample j of the k-th prompt drawn is correct: prompt 0 mod 3 at j = 2, 1 mod 3 at j = 1 and 3,
    2 mod 3 never."""
    return (k % 3 == 0 and j == 2) or (k % 3 == 1 and j in (1, 3))


class StubEngine:
    """Answers prompts in the order drawn: sample j of prompt k is right or wrong as ``plan`` says."""

    def __init__(self, task, codec, seed: int):
        self.task, self.codec, self.k, self.calls = task, codec, 0, []
        self.rng = np.random.default_rng(seed)  # replays task.sample_train's draws

    def make_generator(self, seed):
        return ("generator", seed)

    def next_prompt(self, ids):
        prompt = self.task.sample_train(self.rng)
        assert list(ids) == self.codec.encode_prompt(prompt.messages)
        self.k += 1
        return self.k - 1, prompt

    def text(self, k: int, j: int, prompt) -> list[int]:
        value = int(prompt.answer) + (0 if plan(k, j) else 1)
        return self.codec.encode_text(f"try {j}: {value}") + [self.codec.eos_ids[0]]

    def generate(self, prompts, n, *, max_new_tokens, temperature, top_p, eos_ids, generator, greedy=False):
        self.calls.append((len(prompts), n, max_new_tokens, temperature, top_p, tuple(eos_ids), generator, greedy))
        out = []
        for ids in prompts:
            k, prompt = self.next_prompt(ids)
            out.append([Completion(self.text(k, j, prompt), [0.0], "stop") for j in range(n)])
        return out, GenStats()


def test_rft_keeps_the_first_correct_sample_of_each_prompt_tokens_as_sampled(codec):
    task = ArithmeticTask()
    engine = StubEngine(task, codec, seed=3)
    seen = []
    got = rejection_sample(engine, task, codec, None, examples=5, samples=4, max_new_tokens=12, temperature=0.7,
                           top_p=0.9, seed=3, note=seen.append)
    # 64 samples per call // 4 samples = 16 prompts in the first call, which keeps enough
    assert engine.calls == [(16, 4, 12, 0.7, 0.9, codec.eos_ids, ("generator", 3), False)]
    assert (got.tried, got.prompts) == (64, 16) and [tuple(p) for p in seen] == [(5, 64, 16)]
    replay = np.random.default_rng(3)
    prompts = [task.sample_train(replay) for _ in range(16)]
    want = [(k, 2 if k % 3 == 0 else 1) for k in (0, 1, 3, 4, 6)]  # the first correct sample of kept prompts
    assert len(got.rows) == 5
    for (k, j), row in zip(want, got.rows, strict=True):
        p = prompts[k]
        assert row.prompt.tolist() == codec.encode_prompt(p.messages)
        assert row.tokens.tolist() == codec.encode_text(f"try {j}: {p.answer}") + [codec.eos_ids[0]]
        assert row.roles.tolist() == [ROLE_ACTION] * len(row.tokens)
        assert task.is_correct(p, codec.decode(row.tokens))


def test_rft_stops_at_the_prompt_cap_when_too_few_are_correct(codec):
    task = ArithmeticTask()
    got = rejection_sample(StubEngine(task, codec, seed=0), task, codec, None, examples=40, samples=8,
                           max_new_tokens=12, temperature=1.0, top_p=1.0, seed=0, max_prompts=20)
    # 8 prompts per call: 8, 8, then the 4 left under the cap; prompts 0 and 1 mod 3 of 20 are kept
    assert (got.prompts, got.tried, len(got.rows)) == (20, 160, 14)


def walk_episode(row) -> Episode:
    return Episode(tokens=row.tokens.tolist(), logprobs=[0.0] * len(row.tokens), roles=row.roles.tolist(),
                   end_reason="answer")


class StubEpisodeEngine(StubEngine):
    """Walk episodes: the optimal walk (built as the demonstrations are) where ``plan`` says correct, else an
    answer at the start (wrong: the goal is elsewhere)."""

    def generate_episodes(self, prompts, n, driver, *, temperature, top_p, generator, greedy=False):
        groups = []
        for ids in prompts:
            k, prompt = self.next_prompt(ids)
            start, goal = self.task.problem(prompt.id)
            move = f"<move>{'right' if goal > start else 'left'}</move>"
            good = Demo(prompt, (move,) * abs(goal - start) + ("<answer>done</answer>",))
            bad = Demo(prompt, ("<answer>done</answer>",))
            rows, dropped = build_rows([good, bad], self.task, self.codec, LocalTools(), 16, strict=True)
            assert dropped == 0
            groups.append([walk_episode(rows[0] if plan(k, j) else rows[1]) for j in range(n)])
        return groups, GenStats()


def test_rft_on_a_multi_turn_task_keeps_the_correct_episodes_tokens_and_roles(codec):
    task = WalkTask(size=5)
    engine = StubEpisodeEngine(task, codec, seed=1)
    got = rejection_sample(engine, task, codec, LocalTools(), examples=3, samples=4, max_new_tokens=16,
                           temperature=1.0, top_p=1.0, seed=1)
    replay = np.random.default_rng(1)
    prompts = [task.sample_train(replay) for _ in range(16)]
    assert (got.prompts, got.tried) == (12, 48) and len(got.rows) == 3  # the cap: 3 x 4 prompts
    for k, row in zip((0, 1, 3), got.rows, strict=True):
        p = prompts[k]
        start, goal = task.problem(p.id)
        assert row.prompt.tolist() == codec.encode_prompt(p.messages)
        assert task.is_correct(p, episode_text(row.tokens.tolist(), row.roles.tolist(), codec.decode))
        assert set(row.roles.tolist()) > {ROLE_ACTION}  # observations kept with their own roles
        assert codec.decode(row.tokens).count("</move>") == abs(goal - start)


def cfg_of(url: str, **kw):
    from stoa.config import TrainerConfig

    base = dict(bucket=url, run="r", model="tiny", task="arithmetic", n_samples=2, eval_n=0, kl_beta=0.0,
                anchor_every=100, groups_per_step=2, staleness_bound=1, poll_seconds=0.01, metrics_flush_rows=1,
                log_dir="", cold_start="rft", cold_start_steps=2, cold_start_examples=4, cold_start_batch=4,
                cold_start_rft_samples=2, max_new_tokens=6)
    return TrainerConfig(**{**base, **kw}).validate()


def start(cfg, lines: list[str]):
    from stoa.trainer.loop import _Trainer

    t = _Trainer(cfg, echo=lines.append)
    try:
        t.open_lifecycle()
        t.resume()
        t.metrics.close()
    finally:
        t.close()
    return t


def test_no_correct_sample_refuses_with_one_line_and_trains_nothing(tmp_path, stoa_cache, monkeypatch):
    from stoa.trainer.ranks import RankOps

    def never(*_a, **_k):
        raise AssertionError("trained with no correct sample")
    monkeypatch.setattr(RankOps, "cold_start", never)
    monkeypatch.setattr(ArithmeticTask, "is_correct", lambda self, p, text: False)
    url = str(tmp_path / "b")
    with pytest.raises(SystemExit) as e:
        start(cfg_of(url), [])
    msg = str(e.value)
    assert "\n" not in msg and "none of 32 samples of 16 training prompts" in msg
    assert "use cold_start = demos or a JSONL file, or raise cold_start_rft_samples" in msg
    bucket = open_bucket(url)
    assert read_marker(bucket, "r") is None and not [r for r in read_bucket_metrics(bucket, "r") if "sft/loss" in r]
    assert not list(bucket.list("runs/r/weights/"))


def test_the_trainer_trains_on_the_kept_samples_and_records_kept_and_tried(tmp_path, stoa_cache, monkeypatch):
    from stoa.trainer.ranks import RankOps

    verdicts: list[bool] = []

    def every_third(self, prompt, text):  # the 1st, 4th, 7th ... sample judged is correct
        verdicts.append(len(verdicts) % 3 == 0)
        return verdicts[-1]
    trained = []
    real = RankOps.cold_start
    monkeypatch.setattr(RankOps, "cold_start", lambda self, rows: trained.append(rows) or real(self, rows))
    monkeypatch.setattr(ArithmeticTask, "is_correct", every_third)
    url, lines = str(tmp_path / "b"), []
    start(cfg_of(url), lines)
    marker = read_marker(open_bucket(url), "r")
    assert marker is not None and marker["state"] == "done" and marker["source"] == "rft"
    assert (marker["kept"], marker["tried"], marker["prompts"], marker["samples"]) == (4, 32, 16, 2)
    assert marker["examples"] == 4 and marker["steps"] == 2
    assert "[trainer] cold start rft: kept 4/4 from 32 samples of 16 prompts" in lines
    assert "[trainer] cold start: 2 steps on 4 of the policy's own correct samples (rft: 4 kept of 32 samples)" in lines
    rows = [r for r in read_bucket_metrics(open_bucket(url), "r") if "sft/rft_kept" in r]
    assert [(r["sft/rft_kept"], r["sft/rft_tried"]) for r in rows] == [(4, 32)]
    assert len(trained) == 1 and len(trained[0]) == 4
    assert all(set(r.roles.tolist()) == {ROLE_ACTION} for r in trained[0])
    stored = json.loads(open_bucket(url).get("runs/r/config.json"))["settings"]
    assert stored["cold_start"] == "rft" and stored["cold_start_rft_samples"] == 2


def test_rank_zeros_engine_holds_the_current_weights_sharded_or_not(tiny_dir, codec):
    torch.manual_seed(0)
    policy = Policy(tiny_dir, torch.device("cpu"))
    with torch.no_grad():  # weights unlike the base model's: the engine must take the exported ones
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    prompt = [codec.encode_prompt([{"role": "user", "content": "What is 2 + 3?"}])]
    want, _ = engine_from_model(policy.model).generate(prompt, 1, max_new_tokens=8, greedy=True)
    policy.model.train()
    with sampling_engine(policy, False, policy.export_f32, None, "float32") as engine:
        assert engine.model is policy.model
    assert policy.model.training
    with sampling_engine(policy, True, policy.export_f32, tiny_dir, "float32") as engine:
        assert engine.model is not policy.model
        got, _ = engine.generate(prompt, 1, max_new_tokens=8, greedy=True)
    assert got[0][0].tokens == want[0][0].tokens


def test_rft_samples_must_be_at_least_one(tmp_path):
    from stoa.config.base import ConfigError

    with pytest.raises(ConfigError, match="cold_start_rft_samples"):
        cfg_of(str(tmp_path), cold_start_rft_samples=0)
    with pytest.raises(ConfigError, match="'', 'demos', 'rft' or a .jsonl"):
        cfg_of(str(tmp_path), cold_start="rtf")
