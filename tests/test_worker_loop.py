"""run_worker end to end on the tiny model: records at the adopted version, seq order, metrics per record."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import stoa.worker.loop as loop
from stoa.bucket import open_bucket
from stoa.config import WorkerConfig, load_config
from stoa.contract import ModelSpec, RunContract, SamplingSpec
from stoa.layout import contract_key
from stoa.models import model_fingerprint
from stoa.rollouts.records import RolloutRecord
from stoa.telemetry.metrics import read_metrics
from stoa.weights.planes import state_from_f32
from stoa.weights.publish import WeightPublisher


def test_run_worker_uploads_records_at_the_version_it_adopted(tiny_dir: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = open_bucket(str(tmp_path / "b"))
    fp = model_fingerprint(tiny_dir)
    model = ModelSpec(fp.architecture, fp.config_hash, fp.tokenizer_hash, 512)
    contract = RunContract(run_id="r", model=model, n_samples=2, plane="bf16", task_id="toy", task_spec={},
                           reward_version="1", sampling=SamplingSpec(max_new_tokens=4),
                           created_at=time.time())
    bucket.put_create(contract_key("r"), contract.to_json())
    f32 = {k: v.astype(np.float32) for f in sorted(tiny_dir.glob("model*.safetensors"))
           for k, v in load_file(str(f)).items()}
    pub = WeightPublisher(bucket, "r", "bf16")
    pub.publish(1, state_from_f32(f32, "bf16"))
    build = loop.make_engine

    def engine_that_publishes_v2_after_its_first_batch(*args, **kwargs):
        eng = build(*args, **kwargs)
        generate = eng.generate

        def gen(*a, **k):
            out = generate(*a, **k)
            if pub.pointer.version == 1:
                pub.publish(2, state_from_f32({n: v * np.float32(1.01) for n, v in f32.items()}, "bf16"))
            return out
        eng.generate = gen
        return eng

    monkeypatch.setattr(loop, "make_engine", engine_that_publishes_v2_after_its_first_batch)
    cfg = load_config(WorkerConfig, env={}, overrides={
        "bucket": str(tmp_path / "b"), "run": "r", "name": "w", "model": str(tiny_dir), "engine": "torch",
        "threads": 1, "max_groups": 3, "groups_in_flight": 2, "poll_seconds": 0.01, "wait_seconds": 5,
        "seed": 1, "log_dir": str(tmp_path / "logs")})
    lines: list[str] = []
    s = loop.run_worker(cfg, echo=lines.append)
    assert s["groups"] == 3 and s["versions"] == [1, 2] and s["tokens"] > 0
    keys = (tmp_path / "b" / "runs" / "r" / "rollouts").rglob("*.rec")
    recs = sorted((RolloutRecord.decode(p.read_bytes()) for p in keys), key=lambda r: r.seq)
    assert [(r.seq, r.policy_version) for r in recs] == [(0, 1), (1, 1), (2, 2)]  # a batch of 2, then 1 at v2
    assert all(r.worker_id == s["worker_id"] and len(r.samples) == 2 for r in recs)
    rows = read_metrics(next((tmp_path / "logs").glob("worker-*.jsonl")))
    assert sum("worker/adoption_latency_s" in r for r in rows) == 2  # first record at v1, first at v2
    assert sum("worker/reward_mean" in r for r in rows) == 3
    assert sum("worker/tokens_per_s" in r for r in rows) == 2
    assert any("now at v2" in line for line in lines)


def test_a_multi_turn_worker_queues_episode_queue_batches_on_the_decode_slots_of_one(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``episode_queue`` 4 (the default): each ``generate_episodes`` call holds 4 x groups_in_flight groups, decoded
    groups_in_flight x n rows at a time (torch ``decode_slots``: continuous batching)."""
    from stoa.tasks import get_task

    bucket = open_bucket(str(tmp_path / "b"))
    fp = model_fingerprint(tiny_dir)
    task = get_task("walk", size=3, max_turns=2, max_total_tokens=64)
    contract = RunContract(run_id="r", model=ModelSpec(fp.architecture, fp.config_hash, fp.tokenizer_hash, 512),
                           n_samples=2, plane="bf16", task_id="walk", task_spec=dict(task.spec()), reward_version="1",
                           sampling=SamplingSpec(max_new_tokens=4), created_at=time.time())
    bucket.put_create(contract_key("r"), contract.to_json())
    f32 = {k: v.astype(np.float32) for f in sorted(tiny_dir.glob("model*.safetensors"))
           for k, v in load_file(str(f)).items()}
    WeightPublisher(bucket, "r", "bf16").publish(1, state_from_f32(f32, "bf16"))
    build, calls = loop.make_engine, []

    def recording_engine(*args, **kwargs):
        eng = build(*args, **kwargs)
        episodes = eng.generate_episodes

        def gen(prompts, n, driver, **k):
            calls.append((eng.decode_slots, driver.rows))
            return episodes(prompts, n, driver, **k)
        eng.generate_episodes = gen
        return eng

    monkeypatch.setattr(loop, "make_engine", recording_engine)
    cfg = load_config(WorkerConfig, env={}, overrides={
        "bucket": str(tmp_path / "b"), "run": "r", "name": "w", "model": str(tiny_dir), "engine": "torch",
        "threads": 1, "max_groups": 6, "groups_in_flight": 1, "poll_seconds": 0.01, "wait_seconds": 5,
        "seed": 1, "log_dir": str(tmp_path / "logs")})
    assert cfg.episode_queue == 4
    s = loop.run_worker(cfg, echo=lambda _: None)
    assert s["groups"] == 6 and calls == [(2, 8), (2, 4)]  # 4 groups x n=2 on 1 group's 2 rows, then the 2 left


def test_episode_queue_sets_decode_slots_only_for_episodes_on_an_engine_that_has_them():
    from types import SimpleNamespace

    torch_like = SimpleNamespace(decode_slots=0)
    assert loop.episode_queue(torch_like, True, 8, 3) == 3 and torch_like.decode_slots == 8
    single = SimpleNamespace(decode_slots=0)
    assert loop.episode_queue(single, False, 8, 3) == 1 and single.decode_slots == 0
    assert loop.episode_queue(SimpleNamespace(), True, 8, 3) == 1  # MLX: every row at once, no queue
    with pytest.raises(Exception, match="episode_queue"):
        load_config(WorkerConfig, env={}, overrides={"run": "r", "episode_queue": 0})
