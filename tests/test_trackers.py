"""Trackers (``--report-to wandb,tensorboard``) with fake ``wandb`` / ``tensorboardX`` / torch modules injected
into ``sys.modules``: rows reach both, a failing tracker is dropped after one warning, the trainer resumes the
W&B run whose id is in the bucket, workers join the run's group, a missing package only warns."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from stoa.bucket import open_bucket
from stoa.config import ConfigError, LocalConfig, TrainerConfig, WorkerConfig, load_config
from stoa.config.text import add_config_flags, overrides_from_args
from stoa.layout import tracker_key
from stoa.telemetry.metrics import MetricsWriter, read_metrics
from stoa.telemetry.trackers import (
    Completion,
    TensorBoardTracker,
    TrackerSet,
    WandbTracker,
    completions_every_from_env,
    open_trackers,
    sample_completions,
    tensorboard_modules,
)


@dataclass
class FakeRun:
    id: str
    project: str
    entity: str = "team"
    fail: bool = False
    logged: list[tuple[dict[str, Any], int | None]] = field(default_factory=list)
    finished: int = 0

    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        if self.fail:
            raise RuntimeError("wandb is down")
        self.logged.append((values, step))

    def finish(self) -> None:
        self.finished += 1


class FakeTable:
    def __init__(self, columns: list[str], data: list[list[Any]]) -> None:
        self.columns, self.data = columns, data


def fake_wandb(fail: bool = False) -> types.ModuleType:
    mod = types.ModuleType("wandb")
    mod.inits = []  # type: ignore[attr-defined]
    mod.runs = []  # type: ignore[attr-defined]

    def init(**kw: Any) -> FakeRun:
        mod.inits.append(kw)  # type: ignore[attr-defined]
        run = FakeRun(id=kw.get("id") or f"wb{len(mod.inits)}", project=kw["project"], fail=fail)  # type: ignore[attr-defined]
        mod.runs.append(run)  # type: ignore[attr-defined]
        return run

    mod.init = init  # type: ignore[attr-defined]
    mod.Table = FakeTable  # type: ignore[attr-defined]
    return mod


def fake_tensorboard(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.writers = []  # type: ignore[attr-defined]

    class SummaryWriter:
        def __init__(self, log_dir: str) -> None:
            self.log_dir, self.scalars, self.closed = log_dir, [], False
            mod.writers.append(self)  # type: ignore[attr-defined]

        def add_scalar(self, tag: str, value: float, step: int | None) -> None:
            self.scalars.append((tag, value, step))

        def close(self) -> None:
            self.closed = True

    mod.SummaryWriter = SummaryWriter  # type: ignore[attr-defined]
    return mod


@pytest.fixture
def fakes(monkeypatch):
    """Fake wandb and tensorboardX; torch's tensorboard unimportable, so tensorboardX is the one used."""
    wandb, tbx = fake_wandb(), fake_tensorboard("tensorboardX")
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "tensorboardX", tbx)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    return types.SimpleNamespace(wandb=wandb, tbx=tbx)


def test_rows_reach_wandb_and_tensorboard_and_the_jsonl(tmp_path, fakes):
    bucket = open_bucket(str(tmp_path / "b"))
    trackers = open_trackers("wandb,tensorboard", run_id="r1", source="trainer", bucket=bucket,
                             log_dir=tmp_path / "logs", config=TrainerConfig(run="r1"))
    assert [type(t) for t in trackers] == [WandbTracker, TensorBoardTracker]
    w = MetricsWriter(tmp_path / "logs" / "trainer.jsonl", "r1", trackers=trackers)
    w.log({"rollout/reward_mean": 0.5, "version": 1, "rollout/keys": ["a"], "flag": True}, step=1)
    w.log({"rollout/reward_mean": float("nan"), "version": 2}, step=2)
    w.close(upload=False)
    run = fakes.wandb.runs[0]
    assert run.logged == [({"rollout/reward_mean": 0.5, "version": 1.0}, 1), ({"version": 2.0}, 2)]
    assert run.finished == 1
    writer = fakes.tbx.writers[0]
    assert writer.log_dir == str(tmp_path / "logs" / "tensorboard" / "trainer")
    assert writer.scalars == [("rollout/reward_mean", 0.5, 1), ("version", 1.0, 1), ("version", 2.0, 2)]
    assert writer.closed
    assert [r["step"] for r in read_metrics(tmp_path / "logs" / "trainer.jsonl")] == [1, 2]
    init = fakes.wandb.inits[0]
    assert init["project"] == "stoa" and init["group"] == "r1" and init["config"]["run"] == "r1"


def test_a_failing_tracker_is_disabled_after_one_warning(tmp_path, monkeypatch, fakes, caplog):
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(fail=True))
    trackers = open_trackers(["wandb", "tensorboard"], run_id="r1", source="worker-w0", log_dir=tmp_path)
    w = MetricsWriter(tmp_path / "w.jsonl", "w0", trackers=trackers)
    with caplog.at_level(logging.WARNING, logger="stoa.telemetry.trackers"):
        for step in range(1, 4):
            w.log({"worker/groups": step}, step=step)
    assert len(caplog.records) == 1
    assert w.trackers.disabled == ["wandb"] and [t.name for t in w.trackers.trackers] == ["tensorboard"]
    assert [s for _, _, s in fakes.tbx.writers[0].scalars] == [1, 2, 3]
    assert [r["worker/groups"] for r in read_metrics(tmp_path / "w.jsonl")] == [1, 2, 3]
    w.close()


def test_a_restarted_trainer_resumes_the_stored_wandb_run(tmp_path, fakes, monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "proj")
    bucket = open_bucket(str(tmp_path / "b"))
    first = open_trackers("wandb", run_id="r1", source="trainer", bucket=bucket, log_dir=tmp_path)
    stored = json.loads(bucket.get(tracker_key("r1", "wandb")))
    assert stored == {"id": "wb1", "project": "proj", "entity": "team"}
    monkeypatch.setenv("WANDB_PROJECT", "other")  # the stored project wins: it is the same W&B run
    second = open_trackers("wandb", run_id="r1", source="trainer", bucket=bucket, log_dir=tmp_path)
    assert len(first) == len(second) == 1
    a, b = fakes.wandb.inits
    assert "id" not in a and a["resume"] == "allow"
    assert b["id"] == "wb1" and b["resume"] == "allow" and b["project"] == "proj" and b["entity"] == "team"
    assert json.loads(bucket.get(tracker_key("r1", "wandb")))["id"] == "wb1"


def test_local_mode_keeps_the_wandb_id_in_its_output_dir(tmp_path, fakes):
    for _ in range(2):
        open_trackers("wandb", run_id="out", source="local", log_dir=tmp_path)
    assert [kw.get("id") for kw in fakes.wandb.inits] == [None, "wb1"]


def test_workers_join_the_runs_group_and_store_nothing(tmp_path, fakes):
    bucket = open_bucket(str(tmp_path / "b"))
    open_trackers("wandb", run_id="r1", source="worker-w0-abc", bucket=bucket, log_dir=tmp_path)
    (kw,) = fakes.wandb.inits
    assert kw["group"] == "r1" and kw["name"] == "worker-w0-abc" and kw["job_type"] == "worker"
    assert "id" not in kw
    assert not bucket.exists(tracker_key("r1", "wandb"))


def test_missing_packages_warn_and_open_nothing(tmp_path, monkeypatch, caplog):
    for name in ("wandb", "tensorboardX", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: the import raises ImportError
    with caplog.at_level(logging.WARNING, logger="stoa.telemetry.trackers"):
        trackers = open_trackers("wandb,tensorboard", run_id="r", source="trainer", log_dir=tmp_path)
    assert trackers == []
    assert len(caplog.records) == 2
    assert "pip install wandb" in caplog.records[0].getMessage()
    w = MetricsWriter(tmp_path / "m.jsonl", trackers=trackers)
    w.log({"x": 1.0}, step=1)
    w.close()
    assert read_metrics(tmp_path / "m.jsonl")[0]["x"] == 1.0


def test_a_wandb_init_that_raises_is_skipped(tmp_path, monkeypatch, caplog):
    mod = fake_wandb()

    def init(**kw: Any) -> FakeRun:
        raise RuntimeError("not logged in")

    mod.init = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", mod)
    with caplog.at_level(logging.WARNING, logger="stoa.telemetry.trackers"):
        assert open_trackers("wandb", run_id="r", source="trainer", log_dir=tmp_path) == []
    assert len(caplog.records) == 1


def test_tensorboard_prefers_tensorboardx_unless_torch_is_loaded(tmp_path, monkeypatch):
    assert tensorboard_modules(False)[0] == "tensorboardX"
    assert tensorboard_modules(True)[0] == "torch.utils.tensorboard"
    tbx, torch_tb = fake_tensorboard("tensorboardX"), fake_tensorboard("torch.utils.tensorboard")
    monkeypatch.setitem(sys.modules, "tensorboardX", tbx)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", torch_tb)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    open_trackers("tensorboard", run_id="r", source="worker-w0", log_dir=tmp_path)
    assert len(tbx.writers) == 1 and not torch_tb.writers
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    open_trackers("tensorboard", run_id="r", source="trainer", log_dir=tmp_path)
    assert len(torch_tb.writers) == 1 and torch_tb.writers[0].log_dir.endswith("tensorboard/trainer")


def test_completions_table_every_n_steps(tmp_path, fakes, monkeypatch):
    monkeypatch.setenv("STOA_WANDB_COMPLETIONS_EVERY", "5")
    w = MetricsWriter(tmp_path / "m.jsonl", trackers=open_trackers("wandb,tensorboard", run_id="r", source="trainer",
                                                                   log_dir=tmp_path))
    assert [s for s in range(1, 11) if w.completions_due(s)] == [5, 10]
    sample = types.SimpleNamespace(tokens=np.array([3, 4], dtype=np.int32))
    entries = [types.SimpleNamespace(record=types.SimpleNamespace(prompt_id=f"train:{i}", samples=[sample]),
                                     rewards=np.array([float(i), 0.0])) for i in range(6)]
    rows = sample_completions(entries, lambda toks: " ".join(map(str, toks)), k=2)
    assert rows == [Completion("train:0", "3 4", 0.0), Completion("train:1", "3 4", 1.0)]
    w.log_completions(rows, step=5)
    values, step = fakes.wandb.runs[0].logged[-1]
    assert step == 5 and values["completions"].data == [[5, "train:0", "3 4", 0.0], [5, "train:1", "3 4", 1.0]]
    w.close()


def test_completions_every_env():
    assert completions_every_from_env({}) == 10
    assert completions_every_from_env({"STOA_WANDB_COMPLETIONS_EVERY": "0"}) == 0
    assert completions_every_from_env({"STOA_WANDB_COMPLETIONS_EVERY": "x"}) == 10
    assert not TrackerSet([], completions_every=1).completions_due(1)  # no tracker keeps a table


@pytest.mark.parametrize("cls", [TrainerConfig, WorkerConfig, LocalConfig])
def test_report_to_from_flags_and_toml(tmp_path, cls):
    parser = argparse.ArgumentParser()
    add_config_flags(parser, cls)
    args = parser.parse_args(["--report-to", "wandb,tensorboard"])
    assert load_config(cls, overrides=overrides_from_args(args, cls), env={}).report_to == "wandb,tensorboard"
    f = tmp_path / "c.toml"
    f.write_text('report_to = ["tensorboard"]\n')
    assert load_config(cls, toml_path=str(f), env={}).report_to == "tensorboard"
    assert load_config(cls, env={}).report_to == ""


def test_report_to_refuses_an_unknown_tracker():
    with pytest.raises(ConfigError) as e:
        load_config(TrainerConfig, overrides={"report_to": "wandb,mlflow"}, env={})
    assert e.value.field == "report_to"
    assert "mlflow" in str(e.value) and "tensorboard" in str(e.value)


def test_tracker_key_refuses_odd_names():
    assert tracker_key("r", "wandb") == "runs/r/trackers/wandb.json"
    with pytest.raises(ValueError):
        tracker_key("r", "../x")


def test_a_real_tiny_run_reports_to_both_and_a_restarted_trainer_resumes(tmp_path, stoa_cache, fakes, monkeypatch):
    import threading

    from stoa.trainer.loop import run_trainer
    from stoa.worker.loop import run_worker

    monkeypatch.setenv("STOA_WANDB_COMPLETIONS_EVERY", "2")
    url, logs = str(tmp_path / "b"), tmp_path / "logs"
    tcfg = TrainerConfig(bucket=url, run="r", model="tiny", task="toy", n_samples=2, eval_n=0, kl_beta=0.0,
                         groups_per_step=1, poll_seconds=0.05, steps=2, max_new_tokens=4, max_wait_seconds=120,
                         log_dir=str(logs), report_to="wandb,tensorboard").validate()
    wcfg = load_config(WorkerConfig, env={}, overrides={
        "bucket": url, "run": "r", "name": "w0", "engine": "torch", "threads": 1, "poll_seconds": 0.05,
        "wait_seconds": 60, "log_dir": str(logs), "report_to": "wandb,tensorboard"})
    out: dict = {}
    threads = [threading.Thread(target=lambda: out.update(t=run_trainer(tcfg, echo=lambda *_: None))),
               threading.Thread(target=lambda: out.update(w=run_worker(wcfg, echo=lambda *_: None)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=200)
    assert out["t"]["step"] == 2
    inits = {kw["job_type"]: kw for kw in fakes.wandb.inits}
    assert inits["trainer"]["group"] == inits["worker"]["group"] == "r"
    assert inits["worker"]["name"] == f"worker-{out['w']['worker_id']}"
    trainer_run = fakes.wandb.runs[[kw["job_type"] for kw in fakes.wandb.inits].index("trainer")]
    steps = [s for values, s in trainer_run.logged if "rollout/reward_mean" in values]
    assert steps == [1, 2]
    (table,) = [v["completions"] for v, _ in trainer_run.logged if "completions" in v]
    assert table.data[0][0] == 2 and table.data[0][1].startswith("train:") and isinstance(table.data[0][2], str)
    worker_run = fakes.wandb.runs[[kw["job_type"] for kw in fakes.wandb.inits].index("worker")]
    assert any("worker/tokens" in values for values, _ in worker_run.logged)
    writers = {w.log_dir.rsplit("/", 1)[-1]: w for w in fakes.tbx.writers}
    assert set(writers) == {"trainer", f"worker-{out['w']['worker_id']}"}
    assert all(any(tag.startswith(prefix) for tag, _, _ in writers[name].scalars)
               for name, prefix in (("trainer", "rollout/"), (f"worker-{out['w']['worker_id']}", "worker/")))
    stored = json.loads(open_bucket(url).get(tracker_key("r", "wandb")))
    run_trainer(tcfg, echo=lambda *_: None)  # the run already took its steps: it only resumes the W&B run
    assert stored["id"] == trainer_run.id and fakes.wandb.inits[-1]["id"] == trainer_run.id
