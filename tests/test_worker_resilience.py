"""Workers fail closed without dying: refused weights are reported and the last verified ones kept while
usable, too-stale workers pause instead of exiting, outages are waited out, model files are waited for."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stoa.worker.loop as loop
from stoa.bucket import Bucket, BucketUnreachable, ObjectInfo, PatientBucket, open_bucket
from stoa.config import WorkerConfig, load_config
from stoa.contract import ModelSpec, RunContract, SamplingSpec
from stoa.layout import anchor_prefix, patch_key, pointer_key
from stoa.telemetry.metrics import MetricsWriter, read_metrics
from stoa.weights.follow import WeightFollower
from stoa.weights.hashing import state_hash
from stoa.weights.planes import State, state_from_f32
from stoa.weights.publish import WeightPublisher
from stoa.weights.sync import WeightSync

RUN = "run-a"


def _states(n: int) -> list[State]:
    rng = np.random.default_rng(0)
    w = {"a.weight": rng.standard_normal((64, 32)).astype(np.float32) * 0.02,
         "b.weight": rng.standard_normal((96,)).astype(np.float32)}
    out = []
    for _ in range(n):
        out.append(state_from_f32(w, "bf16"))
        w = {k: v + np.float32(1e-3) * rng.standard_normal(v.shape).astype(np.float32) for k, v in w.items()}
    return out


class FakeEngine:
    """Records the state hash of every state it is given."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    def load_state(self, state: State, plane: str) -> None:
        self.loaded.append(state_hash(state))


class Harness:
    """A run in a local bucket, a worker's follower and engine, and what the worker printed and logged."""

    def __init__(self, tmp_path: Path, staleness_bound: int = 3, bucket: Bucket | None = None) -> None:
        self.bucket = bucket or open_bucket(str(tmp_path / "bucket"))
        self.sts = _states(8)
        self.pub = WeightPublisher(self.bucket, RUN, "bf16", anchor_every=100)
        self.cfg = load_config(WorkerConfig, env={}, overrides={"run": RUN, "poll_seconds": 0.01,
                                                                "wait_seconds": 5})
        self.contract = RunContract(run_id=RUN, model=ModelSpec("llama", "c", "t", 512), n_samples=4,
                                    plane="bf16", task_id="toy", task_spec={}, reward_version="1",
                                    sampling=SamplingSpec(), staleness_bound=staleness_bound)
        self.follower = WeightFollower(WeightSync(self.bucket, RUN, "bf16"), staleness_bound, base_delay_s=0.0)
        self.engine = FakeEngine()
        self.lines: list[str] = []
        self.metrics_path = tmp_path / "worker.jsonl"
        self.metrics = MetricsWriter(self.metrics_path)

    def sync(self, current: int | None) -> int:
        return loop._sync(self.follower, self.engine, self.contract, self.cfg, self.lines.append, self.metrics,
                          current)

    def rows(self) -> list[dict[str, Any]]:
        self.metrics.close()
        return read_metrics(self.metrics_path)

    def publish(self, *versions: int) -> None:
        for v in versions:
            self.pub.publish(v, self.sts[v - 1])

    def corrupt(self, key: str) -> None:
        data = bytearray(self.bucket.get(key))
        data[len(data) // 2] ^= 0x10
        self.bucket.put(key, bytes(data))

    def restart_trainer_and_publish(self, version: int) -> None:
        """What a restarted trainer does over a damaged run: resume (refused), then a fresh full anchor."""
        pub = WeightPublisher(self.bucket, RUN, "bf16", anchor_every=100)
        pub.resume()
        assert pub.resume_error is not None
        pub.publish(version, self.sts[version - 1])


def _on_sleep(monkeypatch: pytest.MonkeyPatch, action: Callable[[], None]) -> list[float]:
    """Run ``action`` at the worker's first sleep (a repair while it waits); returns the sleeps seen."""
    slept: list[float] = []

    def sleep(s: float) -> None:
        if not slept:
            action()
        slept.append(s)
        assert len(slept) < 50, "the worker never recovered"

    monkeypatch.setattr(loop.time, "sleep", sleep)
    return slept


def test_corrupt_newest_patch_keeps_the_old_version_then_recovers_from_a_fresh_anchor(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.publish(1, 2)
    assert h.sync(None) == 2
    h.publish(3)
    h.corrupt(patch_key(RUN, 3))
    assert h.sync(2) == 2  # no exception: the worker keeps sampling with v2
    assert h.engine.loaded == [state_hash(h.sts[1])]
    refused = [line for line in h.lines if line.startswith("[worker] refused")]
    assert len(refused) == 2 and all(patch_key(RUN, 3) in line and "checksum" in line for line in refused)
    assert "keeping v2" in refused[0]
    h.restart_trainer_and_publish(4)
    assert h.sync(2) == 4 and h.engine.loaded[-1] == state_hash(h.sts[3])
    rows = h.rows()
    refusal_rows = [r for r in rows if "worker/sync_refused" in r]
    assert [r["worker/sync_refused"] for r in refusal_rows] == [1, 2]
    assert {(r["worker/sync_error"], r["worker/sync_key"]) for r in refusal_rows} == {("checksum", patch_key(RUN, 3))}
    assert rows[-1]["worker/version"] == 4 and rows[-1]["worker/sync_path"] == "anchor"


def test_worker_too_far_behind_pauses_instead_of_exiting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(tmp_path, staleness_bound=1)
    h.publish(1, 2)
    assert h.sync(None) == 2
    h.publish(3)
    h.corrupt(patch_key(RUN, 3))
    h.publish(4)  # the pointer is now 2 versions ahead of the worker's verified v2: beyond the bound
    slept = _on_sleep(monkeypatch, lambda: h.restart_trainer_and_publish(5))
    assert h.sync(2) == 5
    assert slept, "the worker returned stale weights instead of pausing"
    assert any("paused: v2 is 2 versions behind the pointer (v4)" in line for line in h.lines)
    rows = h.rows()
    assert any(r.get("worker/paused") == 1 for r in rows) and rows[-1]["worker/paused"] == 0


def test_corrupt_first_plan_waits_for_verified_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(tmp_path)
    h.cfg = load_config(WorkerConfig, env={}, overrides={"run": RUN, "poll_seconds": 0.01, "wait_seconds": 1e-6})
    h.publish(1)
    h.corrupt(anchor_prefix(RUN, 1) + "model.safetensors")
    _on_sleep(monkeypatch, lambda: h.restart_trainer_and_publish(2))  # wait_seconds is for "nothing published"
    assert h.sync(None) == 2
    assert h.engine.loaded == [state_hash(h.sts[1])]
    assert any("refused" in line and "model.safetensors" in line and "no weights yet" in line for line in h.lines)
    assert any("paused: no verified weights yet" in line for line in h.lines)


def test_a_malformed_pointer_is_refused_and_the_held_version_kept(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.publish(1)
    assert h.sync(None) == 1
    h.bucket.put(pointer_key(RUN), b"[" * 100_000)
    assert h.sync(1) == 1
    assert any(f"refused {pointer_key(RUN)}: bad_pointer" in line for line in h.lines)


def test_no_weights_at_all_still_times_out(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.cfg = load_config(WorkerConfig, env={}, overrides={"run": RUN, "poll_seconds": 0.01, "wait_seconds": 0.05})
    with pytest.raises(TimeoutError, match="published no weights"):
        h.sync(None)


def test_follower_backs_off_with_jitter_and_does_not_poll_meanwhile(tmp_path: Path) -> None:
    now = [0.0]
    h = Harness(tmp_path)
    h.publish(1)
    h.corrupt(anchor_prefix(RUN, 1) + "model.safetensors")
    f = WeightFollower(WeightSync(h.bucket, RUN, "bf16"), 3, base_delay_s=2.0, max_delay_s=10.0,
                       clock=lambda: now[0], rand=lambda: 1.0)
    waits = []
    for i in range(5):
        step = f.step()
        assert step.error is not None and not step.usable and step.refusals
        waits.append(step.retry_in)
        now[0] += step.retry_in / 2
        h.publish(i + 2)
        meanwhile = f.step()
        assert meanwhile.refusals == [] and meanwhile.error is None  # backing off: no sync attempt
        assert meanwhile.target == i + 2  # but the pointer is followed
        now[0] += step.retry_in / 2
    assert waits == [2.0, 4.0, 8.0, 10.0, 10.0]
    assert f.refused_total == 5
    assert 1.0 <= WeightFollower(f.sync, 3, base_delay_s=2.0).delay(1) <= 2.0


class Flaky:
    """A bucket whose first ``n`` calls of the chosen methods raise BucketUnreachable."""

    def __init__(self, inner: Bucket, n: int, methods: tuple[str, ...]) -> None:
        self.inner, self.url, self.left, self.methods = inner, inner.url, n, methods

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.inner, name)
        if name not in self.methods:
            return fn

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.left > 0:
                self.left -= 1
                raise BucketUnreachable("endpoint down (injected)")
            return fn(*args, **kwargs)

        return call

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectInfo]:
        return self.__getattr__("list")(prefix, start_after)


def test_sync_rides_through_an_outage(tmp_path: Path) -> None:
    inner = open_bucket(str(tmp_path / "bucket"))
    flaky = Flaky(inner, 0, ("get_if_changed", "list", "get"))
    notes: list[str] = []
    patient = PatientBucket(flaky, note=notes.append, sleep=lambda s: None)
    h = Harness(tmp_path, bucket=patient)
    h.publish(1)
    flaky.left = 6
    assert h.sync(None) == 1
    assert flaky.left == 0 and patient.outages >= 1
    assert any("answered again" in n for n in notes)


def test_worker_waits_for_the_model_files_of_a_starting_trainer(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import stoa.contract as contract
    from stoa.bucket import ObjectNotFound

    bucket = open_bucket(str(tmp_path / "bucket"))
    src = tmp_path / "model"
    src.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (src / name).write_text(f'{{"name": "{name}"}}')
    bucket.put_create(f"runs/{RUN}/model/config.json", (src / "config.json").read_bytes())  # upload under way
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        if len(sleeps) == 2:
            contract.upload_model_files(bucket, RUN, src)

    monkeypatch.setattr(contract.time, "sleep", sleep)
    notes: list[str] = []
    out = contract.download_model_files(bucket, RUN, tmp_path / "dest", timeout_s=60, poll_s=0.01,
                                        echo=notes.append)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    assert len(sleeps) == 2 and len(notes) == 1 and "waiting for the model files" in notes[0]
    with pytest.raises(ObjectNotFound, match="--model"):
        contract.download_model_files(bucket, "other-run", tmp_path / "d2", timeout_s=0.0)
