"""``stoa eval``: a real tiny run followed to its end (every version evaluated once, across a restart), a damaged
patch refused, a missing run, and the heartbeat a trainer can read."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from stoa.bucket import Bucket, open_bucket
from stoa.cli import main
from stoa.contract import ModelSpec, RunContract, SamplingSpec, upload_model_files
from stoa.evaluator import EvalConfig, evaluated_versions, run_evaluator
from stoa.layout import contract_key, evaluator_key, patch_key, status_key
from stoa.lifecycle import evaluator_present, read_heartbeat, write_heartbeat
from stoa.models import model_fingerprint
from stoa.schemas.control import RunStatus
from stoa.telemetry.metrics import read_bucket_metrics
from stoa.weights.planes import state_from_f32
from stoa.weights.publish import WeightPublisher

RUN = "r"


def eval_rows(bucket: Bucket) -> list[dict]:
    """The ``eval/*`` rows of the run's ``eval`` chunks."""
    return [r for r in read_bucket_metrics(bucket, RUN, source="eval") if "eval/accuracy" in r]


def publish_versions(bucket: Bucket, tiny_dir: Path, versions: int) -> None:
    """A hand-made run: contract, model files, v1 (anchor) and patches up to ``versions``, pointer last."""
    fp = model_fingerprint(tiny_dir)
    contract = RunContract(run_id=RUN, model=ModelSpec(fp.architecture, fp.config_hash, fp.tokenizer_hash, 512),
                           n_samples=2, plane="bf16", task_id="toy", task_spec={}, reward_version="1",
                           sampling=SamplingSpec(max_new_tokens=4), created_at=time.time())
    upload_model_files(bucket, RUN, tiny_dir)
    bucket.put_create(contract_key(RUN), contract.to_json())
    f32 = {k: v.astype(np.float32) for f in sorted(tiny_dir.glob("model*.safetensors"))
           for k, v in load_file(str(f)).items()}
    pub = WeightPublisher(bucket, RUN, "bf16", anchor_every=1000)
    for v in range(1, versions + 1):
        pub.publish(v, state_from_f32({k: a + 0.01 * v for k, a in f32.items()}, "bf16"))


def cfg(url: str, tmp_path: Path, **kw) -> EvalConfig:
    return EvalConfig(bucket=url, run=RUN, engine="torch", n=2, threads=1, poll_seconds=0.02,
                      log_dir=str(tmp_path / "logs"), **kw)


def test_a_real_tiny_run_is_followed_to_its_end_each_version_once_also_across_a_restart(tmp_path, stoa_cache):
    from stoa.config import TrainerConfig, WorkerConfig, load_config
    from stoa.trainer.loop import run_trainer
    from stoa.worker.loop import run_worker

    url = str(tmp_path / "b")
    tcfg = TrainerConfig(bucket=url, run=RUN, model="tiny", task="toy", n_samples=4, eval_n=0, kl_beta=0.0,
                         anchor_every=3, groups_per_step=2, staleness_bound=2, poll_seconds=0.05, steps=5,
                         max_new_tokens=8, lr=3e-2, status_seconds=0.5, max_wait_seconds=120).validate()
    wcfg = load_config(WorkerConfig, env={}, overrides={
        "bucket": url, "run": RUN, "name": "w0", "engine": "torch", "threads": 1, "groups_in_flight": 2,
        "poll_seconds": 0.05, "wait_seconds": 60, "seed": 1, "status_seconds": 0.2, "log_dir": str(tmp_path / "l")})
    out: dict = {"lines": []}

    def evaluate_twice() -> None:  # the first evaluator stops after two versions; a second one takes over
        first = run_evaluator(cfg(url, tmp_path, follow=True, backfill=True, max_versions=2, wait_seconds=60),
                              echo=out["lines"].append)
        second = run_evaluator(cfg(url, tmp_path, follow=True, wait_seconds=60), echo=out["lines"].append)
        out.update(first=first, second=second)

    threads = [threading.Thread(target=lambda: out.update(t=run_trainer(tcfg, echo=lambda *_: None))),
               threading.Thread(target=lambda: out.update(w=run_worker(wcfg, echo=lambda *_: None))),
               threading.Thread(target=evaluate_twice)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    bucket = open_bucket(url)
    final = json.loads(bucket.get(status_key(RUN)))["version"]
    assert final == 6 and out["second"].finished
    assert out["first"].evaluated == [1, 2] and out["second"].already == [1, 2]
    assert out["second"].evaluated == list(range(3, final + 1))
    versions = [r["version"] for r in eval_rows(bucket)]
    assert versions == list(range(1, final + 1))  # every version, each once, in order
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 and r["eval/n"] == 2.0 for r in eval_rows(bucket))
    again = run_evaluator(cfg(url, tmp_path, follow=True), echo=lambda *_: None)  # a third start: nothing left
    assert again.evaluated == [] and again.finished and evaluated_versions(bucket, RUN) == set(range(1, final + 1))
    beat = read_heartbeat(bucket, RUN)
    assert beat is not None and beat.stopped and beat.version == final and not evaluator_present(bucket, RUN, 60)


def test_every_evaluates_multiples_and_the_final_version(tmp_path, tiny_dir):
    url = str(tmp_path / "b")
    bucket = open_bucket(url)
    publish_versions(bucket, tiny_dir, 5)
    bucket.put(status_key(RUN), RunStatus("finished", 5, time.time(), time.time()).to_json())
    summary = run_evaluator(cfg(url, tmp_path, follow=True, backfill=True, every=2), echo=lambda *_: None)
    assert summary.evaluated == [2, 4, 5] and summary.finished
    assert [r["version"] for r in eval_rows(bucket)] == [2, 4, 5]


def test_a_damaged_patch_is_refused_and_nothing_is_evaluated_with_it(tmp_path, tiny_dir, capsys):
    url = str(tmp_path / "b")
    bucket = open_bucket(url)
    publish_versions(bucket, tiny_dir, 3)
    data = bytearray(bucket.get(patch_key(RUN, 3)))
    data[len(data) // 2] ^= 0xFF
    bucket.put(patch_key(RUN, 3), bytes(data))
    args = ["eval", "--bucket", url, "--run", RUN, "--engine", "torch", "--eval-n", "2", "--threads", "1",
            "--log-dir", str(tmp_path / "logs")]
    assert main(args) == 10
    out = capsys.readouterr()
    assert len(out.err.strip().splitlines()) == 1 and f"refused {patch_key(RUN, 3)}" in out.out
    assert eval_rows(bucket) == []
    # following a finished run whose final patch is damaged: v1 and v2 cannot be bound to the pointer either
    bucket.put(status_key(RUN), RunStatus("finished", 3, time.time(), time.time()).to_json())
    assert main([*args, "--follow", "--backfill", "--poll-seconds", "0.01"]) == 10
    assert eval_rows(bucket) == []
    # once the trainer republishes a good v3 patch, the same command evaluates v3 (and only it)
    publish_versions(bucket2 := open_bucket(str(tmp_path / "c")), tiny_dir, 3)
    bucket.put(patch_key(RUN, 3), bucket2.get(patch_key(RUN, 3)))
    assert main(args) == 0
    assert [r["version"] for r in eval_rows(bucket)] == [3]


def test_a_missing_run_is_one_line_and_exit_12(tmp_path, capsys):
    open_bucket(str(tmp_path / "b"))
    assert main(["eval", "--bucket", str(tmp_path / "b"), "--run", "nope"]) == 12
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'nope'" in err[0] and str(tmp_path / "b") in err[0]


def test_the_heartbeat_says_whether_an_evaluator_is_present(tmp_path):
    bucket = open_bucket(str(tmp_path / "b"))
    assert not evaluator_present(bucket, RUN, 60)
    beat = write_heartbeat(bucket, RUN, 3)
    assert evaluator_present(bucket, RUN, 60) and not evaluator_present(bucket, RUN, 60, now=beat.time + 61)
    write_heartbeat(bucket, RUN, 3, stopped=True)
    assert not evaluator_present(bucket, RUN, 60)
    for bad in (b"\xff", b"[]", b'{"time": "now", "host": "h", "pid": 1}', b'{"time": 1e999}', b"{" * 5000):
        bucket.put(evaluator_key(RUN), bad)
        assert read_heartbeat(bucket, RUN) is None and not evaluator_present(bucket, RUN, 1e12)


def test_the_trainer_leaves_periodic_evals_to_a_live_evaluator(tmp_path) -> None:
    from types import SimpleNamespace

    from stoa.bucket import open_bucket
    from stoa.lifecycle import write_heartbeat
    from stoa.trainer.loop import _Trainer

    bucket = open_bucket(str(tmp_path / "b"))
    trainer = SimpleNamespace(bucket=bucket, cfg=SimpleNamespace(run="r"))
    assert not _Trainer.evaluator_running(trainer)  # type: ignore[arg-type]  # no evaluator yet
    write_heartbeat(bucket, "r", 3)
    assert _Trainer.evaluator_running(trainer)  # type: ignore[arg-type]
    write_heartbeat(bucket, "r", 3, stopped=True)
    assert not _Trainer.evaluator_running(trainer)  # type: ignore[arg-type]


def test_a_trainer_with_a_live_evaluator_keeps_only_its_first_eval(tmp_path, stoa_cache) -> None:
    from stoa.config import TrainerConfig, WorkerConfig, load_config
    from stoa.lifecycle import write_heartbeat
    from stoa.telemetry.metrics import read_bucket_metrics
    from stoa.trainer.loop import run_trainer
    from stoa.worker.loop import run_worker

    url = str(tmp_path / "b")
    write_heartbeat(open_bucket(url), RUN, None)  # an evaluator follows the run from its start
    tcfg = TrainerConfig(bucket=url, run=RUN, model="tiny", task="toy", n_samples=4, eval_n=2, eval_every=1,
                         kl_beta=0.0, groups_per_step=2, poll_seconds=0.05, steps=3, max_new_tokens=8,
                         status_seconds=0.5, max_wait_seconds=120).validate()
    wcfg = load_config(WorkerConfig, env={}, overrides={
        "bucket": url, "run": RUN, "name": "w0", "engine": "torch", "threads": 1, "groups_in_flight": 2,
        "poll_seconds": 0.05, "wait_seconds": 60, "seed": 1, "status_seconds": 0.2, "log_dir": str(tmp_path / "l")})
    worker = threading.Thread(target=lambda: run_worker(wcfg, echo=lambda *_: None))
    worker.start()
    summary = run_trainer(tcfg, echo=lambda *_: None)
    worker.join(timeout=60)
    evals = [r for r in read_bucket_metrics(open_bucket(url), RUN) if "eval/accuracy" in r]
    assert summary["step"] == 3 and [r["version"] for r in evals] == [1]  # eval_every=1 left to the evaluator
