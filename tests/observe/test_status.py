"""``stoa status``: a run's state from its bucket alone, on a hand-written run (exact figures, request counts),
hostile bytes, a missing run, moto S3, ``--watch``, and a real tiny trainer + worker run, live and finished."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

import stoa.observe.snapshot as snapshot
from stoa.bucket import Bucket, BucketUnreachable, open_bucket
from stoa.cli import main
from stoa.layout import (
    journal_key,
    lease_key,
    metrics_chunk_key,
    metrics_prefix,
    model_file_key,
    parse_metrics_chunk_key,
    pointer_key,
    rollout_key,
    rollouts_prefix,
    status_key,
)
from stoa.observe.snapshot import ChunkCache, parse_chunk, take_snapshot
from stoa.observe.spark import BLOCKS, resample, sparkline
from stoa.observe.status import render
from stoa.schemas.control import LeaseRecord, RunStatus
from stoa.telemetry.metrics import BucketMetrics
from stoa.weights.pointer import Pointer
from tests.bucket.conftest import TEST_BUCKET, moto_endpoint, moto_env  # noqa: F401 - fixture used below

RUN = "r"
REWARDS = [0.1, 0.2, 0.4, 0.8]


def _chunks(bucket: Bucket, source: str, start: float, rows: list[dict], flush_rows: int = 3) -> None:
    """Write ``rows`` with the real chunk writer (``start``: the writing process's start)."""
    sink = BucketMetrics(bucket, RUN, source, flush_rows=flush_rows, clock=lambda: start)
    for row in rows:
        sink.add(row)
    assert sink.flush()


def write_run(bucket: Bucket, now: float) -> None:
    """A running run at v5 after 4 steps: status, pointer, lease, journal, trainer and worker metrics chunks,
    and records of a worker without metrics (w2); ``old`` stopped two hours ago."""
    bucket.put_create(model_file_key(RUN, "config.json"), b"{}")
    bucket.put(status_key(RUN), RunStatus("running", 5, now - 3, now - 3, 4, 1.0).to_json())
    iso = datetime.fromtimestamp(now - 7, UTC).isoformat(timespec="milliseconds")
    bucket.cas(pointer_key(RUN), Pointer(RUN, 5, 1, "bf16", "h" * 32, iso).to_json(), None)
    bucket.cas(lease_key(RUN), LeaseRecord("abc", "gpu-box", 4242, now - 100, now - 2, 3).to_json(), None)
    bucket.put(journal_key(RUN), json.dumps({"version": 5, "step": 4, "pool": {}, "quarantine": {
        "v": 1, "threshold": 0.1, "workers": {"w1": [10, 2, 0, 0, 0, ""], "w2": [4, 4, 0, 0, 0, "reject_rate"]}}}
    ).encode())
    steps = [{"time": now - 40 + 6 * s, "step": s, "version": s + 1, "rollout/reward_mean": REWARDS[s - 1],
              "rollout/records_per_s": float(s), "rollout/staleness/0": 3, "rollout/staleness/1": 1,
              "rollout/rejected/duplicate": int(s == 2), "rollout/rejected/key": 2 * int(s == 4),
              "rollout/keys": [f"v{s:08d}/w1-{s:08d}.rec"], "quarantine/workers": 1.0} for s in range(1, 5)]
    evals = [{"time": now - 30, "version": 3, "eval/accuracy": 0.25, "eval/n": 8},
             {"time": now - 10, "version": 5, "eval/accuracy": 0.5, "eval/n": 8}]
    _chunks(bucket, "trainer", now - 60, steps + evals)
    w1 = [{"time": now - 50, "worker/engine": "mlx", "worker/version": 1},
          {"time": now - 45, "worker/sync_s": 0.5, "worker/version": 2},
          {"time": now - 20, "worker/sync_s": 1.5, "worker/version": 4},
          *({"time": now - 30 + i, "worker/reward_mean": 0.5, "worker/version": 3, "step": i} for i in range(3)),
          {"time": now - 25, "worker/tokens_per_s": 100.0, "worker/version": 3},
          {"time": now - 5, "worker/tokens_per_s": 300.0, "worker/version": 4}]
    _chunks(bucket, "worker-w1", now - 50, w1, flush_rows=100)
    _chunks(bucket, "worker-old", now - 7200, [{"time": now - 7000, "worker/engine": "torch"}])
    for seq, version in enumerate((4, 5, 5)):
        bucket.put_create(rollout_key(RUN, version, "w2", seq), b"record")


def test_a_handwritten_run_reads_back_exactly_and_a_second_look_fetches_no_chunk_again(tmp_path):
    bucket, now = open_bucket(str(tmp_path / "b")), time.time()
    write_run(bucket, now)
    cache: ChunkCache = {}
    s = take_snapshot(bucket, RUN, cache=cache, now=now).to_json()
    assert (s["state"], s["version"], s["plane"], s["step"], s["wanted_groups"]) == ("running", 5, "bf16", 4, 4)
    assert s["heartbeat_age_s"] == pytest.approx(3) and s["version_age_s"] == pytest.approx(7, abs=0.01)
    assert s["trainer"] == {"host": "gpu-box", "pid": 4242, "holder": "abc", "epoch": 3,
                            "heartbeat_age_s": pytest.approx(2), "released": False}
    assert s["reward"] == REWARDS and s["reward_steps"] == [1, 2, 3, 4]
    assert s["steps_per_min"] == pytest.approx(10.0) and s["records_per_s"] == pytest.approx(2.5)
    assert s["lag"] == {"0": 12, "1": 4} and s["rejected"] == {"duplicate": 1, "key": 2} and s["quarantined"] == 1
    assert s["evals"] == [{"version": 3, "accuracy": 0.25, "n": 8.0}, {"version": 5, "accuracy": 0.5, "n": 8.0}]
    w1, w2 = s["workers"]  # "old" last wrote two hours ago: not shown, its chunk never fetched
    assert w1 == {"name": "w1", "engine": "mlx", "versions": [1, 4], "groups": 3, "tokens_per_s": 200.0,
                  "sync_s": 1.0, "rejected": 2, "quarantine": "", "last_seen_age_s": pytest.approx(5),
                  "source": "metrics"}
    assert w2 == {"name": "w2", "engine": "", "versions": [4, 5], "groups": 3, "tokens_per_s": None,
                  "sync_s": None, "rejected": 4, "quarantine": "reject_rate", "last_seen_age_s": None,
                  "source": "keys"}
    assert {k: v["objects"] for k, v in s["sizes"].items()} == {
        "model": 1, "weights": 1, "rollouts": 3, "trainer": 2, "metrics": 4, "retriever": 0, "other": 1}
    assert s["sizes"]["rollouts"]["bytes"] == 18
    # 1 LIST; GETs: status, pointer, lease, journal, 2 trainer chunks, 1 chunk of w1
    assert (s["requests"]["list"], s["requests"]["get"]) == (1, 7) and s["bad_rows"] == s["bad_chunks"] == 0
    again = take_snapshot(bucket, RUN, cache=cache, now=now).to_json()
    assert again["requests"]["get"] == 4 and {**again, "requests": 0} == {**s, "requests": 0}
    screen = render(take_snapshot(bucket, RUN, now=now))
    assert sparkline(REWARDS) in screen and sparkline(REWARDS) == "▁▂▄█"


def test_an_evaluators_rows_join_the_trainers_in_version_order(tmp_path):
    bucket, now = open_bucket(str(tmp_path / "b")), time.time()
    write_run(bucket, now)
    _chunks(bucket, "eval", now - 20, [{"time": now - 15, "version": 4, "eval/accuracy": 0.375, "eval/n": 8},
                                       {"time": now - 14, "version": 6, "eval/cover_em": 0.5, "eval/em": 0.25}])
    s = take_snapshot(bucket, RUN, now=now).to_json()
    assert [e["version"] for e in s["evals"]] == [3, 4, 5, 6]
    assert s["evals"][1] == {"version": 4, "accuracy": 0.375, "n": 8.0}
    assert s["evals"][3] == {"version": 6, "cover_em": 0.5, "em": 0.25}


def test_the_steps_line_shows_the_target_and_the_eta_at_the_recent_rate(tmp_path):
    bucket, now = open_bucket(str(tmp_path / "b")), time.time()
    write_run(bucket, now)  # 4 steps at 10 steps/min in the metrics
    s = take_snapshot(bucket, RUN, now=now)
    assert (s.step, s.target_steps, s.eta_s) == (4, None, None)  # a status without a target: an older trainer
    assert "steps      4 | 10.00 steps/min | 2.50" in render(s)
    bucket.put(status_key(RUN), RunStatus("running", 7, now - 3, now - 3, 4, 1.0, 1, 6, 30).to_json())
    s = take_snapshot(bucket, RUN, now=now)
    assert (s.step, s.target_steps, s.eta_s) == (6, 30, pytest.approx(144.0))  # the status is ahead: 24 left
    assert "steps      6/30 | 10.00 steps/min | ETA 2m24s | 2.50 records/s" in render(s)
    bucket.put(status_key(RUN), RunStatus("running", 7, now - 3, now - 3, 4, 1.0, 1, 6, 0).to_json())
    s = take_snapshot(bucket, RUN, now=now)
    assert (s.target_steps, s.eta_s) == (0, None) and "steps      6 (no target) | 10.00 steps/min |" in render(s)
    bucket.put(status_key(RUN), RunStatus("finished", 7, now - 3, now - 3, None, 1.0, 1, 30, 30).to_json())
    s = take_snapshot(bucket, RUN, now=now)
    assert (s.step, s.eta_s) == (30, None) and "30/30" in render(s)


def test_a_finished_run_shows_the_workers_of_its_last_minutes(tmp_path):
    bucket, now = open_bucket(str(tmp_path / "b")), time.time()
    write_run(bucket, now - 3600)  # everything an hour old, then the trainer finished
    bucket.put(status_key(RUN), RunStatus("finished", 5, now - 3600, now - 3600, None, 1.0).to_json())
    s = take_snapshot(bucket, RUN, now=now)
    assert s.state == "finished" and [w.name for w in s.workers] == ["w1", "w2"]  # window ends at its heartbeat
    assert s.workers[0].source == "metrics" and s.workers[0].last_seen_age_s == pytest.approx(3605)


def test_hostile_bytes_are_skipped_and_counted_never_raised(tmp_path, monkeypatch):
    bucket, now = open_bucket(str(tmp_path / "b")), time.time()
    write_run(bucket, now)
    for key in (status_key(RUN), pointer_key(RUN), lease_key(RUN), journal_key(RUN)):
        bucket.put(key, b"\xff{not json" + b"[" * 5000)
    bad_lines = [b"\xff\xfe garbage", b"[" * 50 + b"]" * 50, b"[1, 2]", b'{"a": NaN}', b'{"x": 1e999}', b'{"step": 1',
                 b'{"a": ' * 10 + b"1" + b"}" * 10]
    odd_rows = [{"step": True, "rollout/reward_mean": "x"},
                {"step": 7, "rollout/reward_mean": "high", "time": "now", "rollout/keys": [1, None, "../../x",
                 "v00000001/ok-00000001.rec"], "rollout/staleness/9999999": 5, "rollout/staleness/x": 1,
                 "rollout/rejected/evil": "many", "eval/accuracy": "1", "quarantine/workers": 1e308}]
    body = b"\n".join([*bad_lines, *(json.dumps(r).encode() for r in odd_rows)]) + b"\n"
    bucket.put_create(metrics_chunk_key(RUN, "trainer", int(now), 0), body)
    bucket.put_create(metrics_chunk_key(RUN, "worker-evil", int(now), 0), json.dumps(
        {"time": now, "worker/version": 1e300, "worker/engine": 5, "worker/tokens_per_s": "fast"}).encode())
    bucket.put_create(metrics_chunk_key(RUN, "trainer", int(now), 1), b"{}\n" * 5000)
    monkeypatch.setattr(snapshot, "MAX_CHUNK_BYTES", 10_000)  # never fetched
    s = take_snapshot(bucket, RUN, now=now)
    assert (s.state, s.version, s.trainer) == ("unknown", None, None)
    assert s.bad_rows == len(bad_lines) and s.bad_chunks == 1
    assert s.reward == [*REWARDS, None] and s.rejected == {"duplicate": 1, "key": 2}
    evil = next(w for w in s.workers if w.name == "evil")
    assert (evil.engine, evil.versions, evil.tokens_per_s, evil.rejected) == ("", [], None, None)
    assert [w.name for w in s.workers] == ["evil", "w1", "w2"]  # "ok": its label's row has no time
    render(s)
    assert parse_chunk(b"\n".join(bad_lines)).bad == len(bad_lines)


def test_a_missing_run_is_one_line_naming_run_and_bucket_and_exit_12(tmp_path, capsys):
    bucket = open_bucket(str(tmp_path / "b"))
    write_run(bucket, time.time())
    assert main(["status", "--bucket", str(tmp_path / "b"), "--run", "nope"]) == 12
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'nope'" in err[0] and str(tmp_path / "b") in err[0]


def test_json_and_watch_until_ctrl_c(tmp_path, capsys, monkeypatch):
    write_run(open_bucket(str(tmp_path / "b")), time.time())
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        if len(sleeps) == 2:
            raise KeyboardInterrupt
    monkeypatch.setattr(time, "sleep", sleep)
    args = ["status", "--bucket", str(tmp_path / "b"), "--run", RUN, "--json"]
    assert main([*args, "--watch", "0.5", "--workers-minutes", "1"]) == 0
    out = capsys.readouterr()
    first, second = (json.loads(line) for line in out.out.splitlines())
    assert sleeps == [0.5, 0.5] and len(out.err.strip().splitlines()) == 1
    assert first["version"] == second["version"] == 5 and first["workers_minutes"] == 1.0
    assert (first["requests"]["get"], second["requests"]["get"]) == (7, 4)  # the redraw fetched no chunk again


def test_an_s3_bucket_reads_like_a_local_one(tmp_path, moto_endpoint, monkeypatch, capsys):  # noqa: F811
    env = moto_env(moto_endpoint)
    url = f"s3://{TEST_BUCKET}/status-{time.time_ns()}"
    now = time.time()
    write_run(open_bucket(url, env), now)
    write_run(local := open_bucket(str(tmp_path / "b")), now)
    on_s3 = take_snapshot(open_bucket(url, env), RUN, now=now).to_json()
    on_disk = take_snapshot(local, RUN, now=now).to_json()
    assert {**on_s3, "bucket": ""} == {**on_disk, "bucket": ""}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["status", "--bucket", url, "--run", RUN, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workers"][0]["name"] == "w1"


class MetricsDown:
    """A worker's bucket whose metrics chunk uploads all fail (everything else passes through)."""

    def __init__(self, inner: Bucket) -> None:
        self.inner, self.url, self.failed = inner, inner.url, 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def put_create(self, key: str, data: bytes) -> None:
        if key.startswith(metrics_prefix(RUN)):
            self.failed += 1
            raise BucketUnreachable("injected: metrics upload down")
        self.inner.put_create(key, data)


@pytest.mark.parametrize("down", [False, True])
def test_a_worker_uploads_its_metrics_as_chunks_and_a_failed_upload_never_stops_it(tiny_dir, tmp_path,
                                                                                   monkeypatch, down):
    import stoa.worker.loop as wloop
    from tests.test_lifecycle import publish_tiny_run, worker_cfg

    bucket = open_bucket(str(tmp_path / "b"))
    publish_tiny_run(bucket, tiny_dir)
    spy = MetricsDown(bucket)
    monkeypatch.setattr(wloop, "open_bucket", lambda *a, **k: spy if down else bucket)
    monkeypatch.setattr(wloop, "METRICS_FLUSH_ROWS", 2)
    summary = wloop.run_worker(worker_cfg(tmp_path, tiny_dir, max_groups=3), echo=lambda *_: None)
    assert summary["groups"] == 3 and len(list(bucket.list(rollouts_prefix(RUN)))) == 3
    chunks = [k for o in bucket.list(metrics_prefix(RUN)) if (k := parse_metrics_chunk_key(RUN, o.key))]
    if down:
        assert spy.failed >= 2 and chunks == []
        return
    assert {c.source for c in chunks} == {f"worker-{summary['worker_id']}"} and len(chunks) >= 2
    (w,) = take_snapshot(bucket, RUN).workers
    assert (w.name, w.engine, w.source, w.groups, w.versions) == (summary["worker_id"], "torch", "metrics", 3, [1, 1])


def test_sparkline_scales_resamples_and_leaves_gaps():
    assert sparkline([0, 1, None, float("nan"), 0.5]) == "▁█  " + BLOCKS[4]
    assert sparkline([2.0, 2.0]) == BLOCKS[4] * 2 and sparkline([]) == ""
    assert resample(list(range(100)), 10) == [i * 10 + 4.5 for i in range(10)]  # cell means
    assert sparkline(list(range(100)), width=10) == "".join(BLOCKS[round(i * 7 / 9)] for i in range(10))


def test_status_of_a_real_tiny_run_while_it_trains_and_once_it_finished(tmp_path: Path, stoa_cache, capsys):
    from stoa.config import TrainerConfig, WorkerConfig, load_config
    from stoa.trainer.loop import run_trainer
    from stoa.worker.loop import run_worker

    url = str(tmp_path / "b")
    tcfg = TrainerConfig(bucket=url, run=RUN, model="tiny", task="toy", n_samples=4, eval_n=4, eval_every=3,
                         kl_beta=0.0, anchor_every=4, groups_per_step=2, staleness_bound=2, poll_seconds=0.05,
                         metrics_flush_rows=1, steps=8, max_new_tokens=8, lr=3e-2, status_seconds=0.5,
                         max_wait_seconds=120).validate()
    wcfg = load_config(WorkerConfig, env={}, overrides={
        "bucket": url, "run": RUN, "name": "w0", "engine": "torch", "threads": 1, "groups_in_flight": 2,
        "poll_seconds": 0.05, "wait_seconds": 60, "seed": 1, "status_seconds": 0.2, "log_dir": str(tmp_path / "l")})
    out: dict = {}
    threads = [threading.Thread(target=lambda: out.update(t=run_trainer(tcfg, echo=lambda *_: None))),
               threading.Thread(target=lambda: out.update(w=run_worker(wcfg, echo=lambda *_: None)))]
    for t in threads:
        t.start()
    bucket, live = open_bucket(url), None
    while threads[0].is_alive() and live is None:
        try:
            s = take_snapshot(bucket, RUN)
        except snapshot.RunNotFound:
            s = None
        live = s if s is not None and (s.step or 0) >= 2 and s.workers else None
        time.sleep(0.2)
    for t in threads:
        t.join(timeout=100)
    assert live is not None and live.state == "running" and live.trainer and not live.trainer.released
    assert live.workers[0].name == out["w"]["worker_id"] and live.workers[0].source in ("trainer", "keys")
    assert main(["status", "--bucket", url, "--run", RUN, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert (s["state"], s["version"], s["step"], len(s["reward"]), s["trainer"]["released"]) == (
        "finished", 9, 8, 8, True)
    assert [e["version"] for e in s["evals"]] == [e["version"] for e in out["t"]["evals"]]
    assert sum(s["lag"].values()) == 8 * 2 and s["rejected"] == {}
    (w,) = s["workers"]
    assert (w["name"], w["engine"], w["source"], w["groups"]) == (out["w"]["worker_id"], "torch", "metrics",
                                                                  out["w"]["groups"])
    assert w["versions"][1] == max(out["w"]["versions"]) and w["tokens_per_s"] > 0
    assert s["sizes"]["weights"]["objects"] > 0 and s["requests"]["list"] == 1 and s["bad_rows"] == 0
