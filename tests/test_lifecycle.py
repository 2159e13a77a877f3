"""Run lifecycle: the status object, the worker's watch (finished, stale trainer, backpressure), the
trainer's status transitions and a worker that exits when the run is finished."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import stoa.worker.loop as wloop
from stoa.bucket import BucketUnreachable, open_bucket
from stoa.config import TrainerConfig, WorkerConfig, load_config
from stoa.contract import ModelSpec, RunContract, SamplingSpec
from stoa.layout import contract_key, metrics_prefix, rollouts_prefix, status_key
from stoa.lifecycle import read_status
from stoa.models import model_fingerprint
from stoa.schemas.control import RunStatus
from stoa.telemetry.metrics import read_bucket_metrics, read_metrics
from stoa.trainer.demand import wanted_groups
from stoa.weights.planes import state_from_f32
from stoa.weights.publish import WeightPublisher
from stoa.worker.pacing import RunWatch


def put_status(bucket, state="running", wanted: int | None = 4, beat=100.0, step_s=0.0, run="r"):
    bucket.put(status_key(run), RunStatus(state, 3, beat, beat, wanted, step_s).to_json())


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_status_round_trips_and_anything_malformed_reads_as_absent():
    s = RunStatus("running", 7, 1.5, 1.5, 0, 2.0, 4)
    assert RunStatus.from_json(s.to_json()) == s
    for bad in (b"", b"[]", b'{"state": "done"}', s.to_json().replace(b'"version": 7', b'"version": -1'),
                s.to_json().replace(b'"wanted_groups": 0', b'"wanted_groups": "0"'), b"x" * 5000):
        assert RunStatus.from_json(bad) is None, bad


def test_watch_exits_when_finished_and_samples_when_in_doubt(tmp_path):
    bucket = open_bucket(str(tmp_path))
    watch = RunWatch(bucket, "r", stale_s=60, min_interval_s=0, clock=Clock())
    assert watch.check().action == "sample"  # no status yet
    bucket.put(status_key("r"), b"{not json")
    assert watch.check().action == "sample"  # malformed
    put_status(bucket, "finished")
    v = watch.check()
    assert v.action == "exit" and "finished at v3" in v.reason


def test_backpressure_pauses_at_zero_wanted_and_resumes_when_positive(tmp_path):
    bucket = open_bucket(str(tmp_path))
    clock = Clock()
    watch = RunWatch(bucket, "r", stale_s=60, min_interval_s=1.0, clock=clock)
    put_status(bucket, wanted=0, beat=1)
    assert watch.check().kind == "backpressure"
    put_status(bucket, wanted=2, beat=2)
    assert watch.check().kind == "backpressure"  # not re-read before min_interval_s
    clock.t = 1.0
    assert watch.check().action == "sample"
    put_status(bucket, wanted=0, beat=3)
    clock.t = 2.0
    assert RunWatch(bucket, "r", stale_s=60, min_interval_s=0, backpressure=False).check().action == "sample"
    assert wanted_groups(4, 3, 10) == 6 and wanted_groups(4, 0, 9) == 0


def test_a_worker_samples_at_most_the_want_per_status_it_read(tmp_path):
    bucket = open_bucket(str(tmp_path))
    watch = RunWatch(bucket, "r", stale_s=60, min_interval_s=0, clock=Clock())
    put_status(bucket, wanted=4, beat=1)
    assert watch.check().action == "sample" and watch.wanted() == 4
    watch.spend(3)
    assert watch.check().action == "sample" and watch.wanted() == 1
    watch.spend(1)
    v = watch.check()  # the same status object re-read: still spent
    assert (v.action, v.kind, watch.wanted()) == ("pause", "backpressure", 0)
    put_status(bucket, wanted=4, beat=2)  # the trainer's next status: a new want
    assert watch.check().action == "sample" and watch.wanted() == 4
    free = RunWatch(bucket, "r", stale_s=60, min_interval_s=0, backpressure=False)
    free.spend(10)
    assert free.check().action == "sample" and free.wanted() is None


def test_watch_pauses_while_the_heartbeat_is_stale_and_resumes_when_it_moves(tmp_path):
    bucket = open_bucket(str(tmp_path))
    clock = Clock()
    watch = RunWatch(bucket, "r", stale_s=30, min_interval_s=0, clock=clock)
    put_status(bucket, beat=1, step_s=20.0)
    assert watch.check().action == "sample"
    clock.t = 50.0  # quiet for 50 s, but 3 steps of 20 s is 60 s
    assert watch.check().action == "sample"
    clock.t = 61.0
    assert watch.check().kind == "stale"
    put_status(bucket, beat=2, step_s=20.0)
    assert watch.check().action == "sample"
    put_status(bucket, "failed", beat=3)
    assert watch.check().kind == "failed"


def make_trainer_cfg(bucket: str, **kw) -> TrainerConfig:
    base = dict(bucket=bucket, run="r", model="tiny", task="toy", n_samples=2, eval_n=0, kl_beta=0.0,
                anchor_every=100, groups_per_step=2, staleness_bound=1, poll_seconds=0.01, metrics_flush_rows=1,
                log_dir="")
    return TrainerConfig(**{**base, **kw}).validate()


class FailingMetrics:
    """The trainer's bucket with every metrics chunk upload failing; records status writes."""

    def __init__(self, inner) -> None:
        self.inner, self.states = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_create(self, key, data):
        if key.startswith(metrics_prefix("r")):
            raise BucketUnreachable("injected: metrics upload down")
        return self.inner.put_create(key, data)

    def put(self, key, data):
        if key == status_key("r"):
            self.states.append(RunStatus.from_json(data).state)
        return self.inner.put(key, data)


def fake_steps(t, fail_at: int | None = None):
    """Replace intake and the step: two groups always available; each step publishes the next version."""
    t.pool.refresh = lambda v: 0
    t.pool.available = lambda: 2
    t.pool.take = lambda n, keep=None, skip_uniform=False: ["g"] * n

    def train(entries):
        if t.step + 1 == fail_at:
            raise RuntimeError("boom")
        t.version, t.step = t.version + 1, t.step + 1
        t.publish(t.version)
        t.metrics.log({"train/loss": 0.0, "version": t.version}, step=t.step)
    t.train = train


def test_trainer_status_goes_running_then_finished_and_a_failing_metrics_upload_does_not_stop_it(
        tmp_path, stoa_cache):
    from stoa.trainer.loop import _Trainer

    url = str(tmp_path / "b")
    t = _Trainer(make_trainer_cfg(url, steps=2), echo=lambda *_: None)
    t.bucket = spy = FailingMetrics(t.bucket)
    fake_steps(t)
    try:
        summary = t.run()
    finally:
        t.close()
    assert summary["step"] == 2 and spy.states[0] == "running" and spy.states[-1] == "finished"
    assert spy.states.count("running") == 2  # at start (v1), after publishing v2; v3 is in "finished"
    status = read_status(open_bucket(url), "r")
    assert status is not None and status.state == "finished" and status.version == 3
    assert t.metrics.sink.failures > 0 and t.metrics.sink.rows  # kept for a later flush


def test_trainer_status_is_failed_after_an_exception_and_metrics_reach_the_bucket(tmp_path, stoa_cache):
    from stoa.trainer.loop import _Trainer

    url = str(tmp_path / "b")
    t = _Trainer(make_trainer_cfg(url, steps=5), echo=lambda *_: None)
    fake_steps(t, fail_at=2)
    with pytest.raises(RuntimeError, match="boom"):
        try:
            t.run()
        finally:
            t.close()
    bucket = open_bucket(url)
    assert read_status(bucket, "r").state == "failed"
    rows = read_bucket_metrics(bucket, "r")
    assert [r["version"] for r in rows if "train/loss" in r] == [2]


def publish_tiny_run(bucket, tiny_dir: Path) -> None:
    fp = model_fingerprint(tiny_dir)
    model = ModelSpec(fp.architecture, fp.config_hash, fp.tokenizer_hash, 512)
    contract = RunContract(run_id="r", model=model, n_samples=2, plane="bf16", task_id="toy", task_spec={},
                           reward_version="1", sampling=SamplingSpec(max_new_tokens=4), created_at=time.time())
    bucket.put_create(contract_key("r"), contract.to_json())
    f32 = {k: v.astype(np.float32) for f in sorted(tiny_dir.glob("model*.safetensors"))
           for k, v in load_file(str(f)).items()}
    WeightPublisher(bucket, "r", "bf16").publish(1, state_from_f32(f32, "bf16"))


def worker_cfg(tmp_path: Path, tiny_dir: Path, **kw) -> WorkerConfig:
    return load_config(WorkerConfig, env={}, overrides={
        "bucket": str(tmp_path / "b"), "run": "r", "name": "w", "model": str(tiny_dir), "engine": "torch",
        "threads": 1, "groups_in_flight": 1, "poll_seconds": 0.01, "wait_seconds": 5, "seed": 1,
        "status_seconds": 0.01, "log_dir": str(tmp_path / "logs"), **kw})


def test_a_worker_exits_0_with_one_line_when_the_run_is_finished(tiny_dir, tmp_path, capsys):
    from stoa.cli import main

    bucket = open_bucket(str(tmp_path / "b"))
    publish_tiny_run(bucket, tiny_dir)
    put_status(bucket, "finished")
    args = ["worker", "--bucket", str(tmp_path / "b"), "--run", "r", "--model", str(tiny_dir), "--engine", "torch",
            "--threads", "1", "--wait-seconds", "5", "--log-dir", str(tmp_path / "logs")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "run 'r' finished at v3; exiting" in out
    assert not list(bucket.list(rollouts_prefix("r")))


def test_a_worker_paused_by_backpressure_uploads_nothing_until_the_trainer_wants_more(
        tiny_dir, tmp_path, monkeypatch):
    bucket = open_bucket(str(tmp_path / "b"))
    publish_tiny_run(bucket, tiny_dir)
    put_status(bucket, wanted=0)
    records_at_each_pause: list[int] = []
    next_status: list[None] = []

    def sleep(_s):  # after three pauses the trainer has taken the pool's groups: it wants 2 more (then 2 again)
        records_at_each_pause.append(len(list(bucket.list(rollouts_prefix("r")))))
        if len(records_at_each_pause) == 3:
            put_status(bucket, wanted=2, beat=101.0)
        elif records_at_each_pause[-1] == 2 and not next_status:  # the worker sampled what the status wanted
            next_status.append(put_status(bucket, wanted=2, beat=102.0))  # until the trainer's next status
    monkeypatch.setattr(wloop.time, "sleep", sleep)
    lines: list[str] = []
    # pacing = false: batches of the share, not a probe first (pacing's batches: tests/test_pacing_rates.py)
    s = wloop.run_worker(worker_cfg(tmp_path, tiny_dir, max_groups=3, groups_in_flight=4, pacing=False),
                         echo=lines.append)
    assert records_at_each_pause[:3] == [0, 0, 0] and set(records_at_each_pause) == {0, 2} and s["groups"] == 3
    assert len(list(bucket.list(rollouts_prefix("r")))) == 3
    batches = [r for r in read_metrics(next((tmp_path / "logs").glob("worker-*.jsonl"))) if "worker/decode_s" in r]
    assert len(batches) == 2  # 2 groups (the want), then 1 (max_groups), never a batch of 3
    assert any("paused: the trainer wants no more groups" in line for line in lines)
    assert any("paused: the trainer got the 2 groups it wanted at v3" in line for line in lines)
    assert any("resumed sampling (backpressure over" in line for line in lines)


def test_an_idle_trainer_lists_less_often_the_longer_nothing_lands():
    from stoa.trainer.demand import poll_delay

    assert [poll_delay(0.5, k) for k in range(6)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]  # capped at 5 s
    assert poll_delay(0.2, 50) == pytest.approx(2.0)  # 10x a short poll: tests stay quick
    assert poll_delay(30.0, 5) == 30.0  # never below the configured wait
    # An hour of waiting at window 8 (9 LIST per poll): 6.5k Class A requests instead of 65k.
    waited, polls = 0.0, 0
    while waited < 3600:
        waited += poll_delay(0.5, polls)
        polls += 1
    assert polls * 9 < 6600
