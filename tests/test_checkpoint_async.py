"""Checkpoints written in the background keep a synchronous checkpoint's order: the state is the step's (a
snapshot), files before the pointer, the pointer never ahead of the weights pointer it claims, one write in
flight, and the trainer waits for the last one before the run ends."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from stoa.bucket import open_bucket
from stoa.layout import checkpoint_files_prefix, checkpoint_pointer_key, status_key
from stoa.trainer import checkpoint as ckpt
from tests.test_trainer_resume import make_cfg


@pytest.fixture
def trainer(tmp_path, stoa_cache):
    from stoa.trainer.loop import _Trainer

    t = _Trainer(make_cfg(str(tmp_path / "b")), echo=lambda *_: None)
    t.resume()  # v1 published, no checkpoint
    yield t
    t.close()


class Gate:
    """Holds every checkpoint file upload of ``bucket`` until ``open()``; counts the files that got through."""

    def __init__(self, bucket, monkeypatch):
        self.event, self.waiting, self.keys, real = threading.Event(), threading.Event(), [], bucket.put_file

        def held(key, path, **kw):
            self.waiting.set()
            assert self.event.wait(30), "the gate was never opened"
            self.keys.append(key)
            return real(key, path, **kw)

        monkeypatch.setattr(bucket, "put_file", held)

    def open(self) -> None:
        self.event.set()


def pointer(bucket) -> ckpt.CheckpointRef:
    ref = ckpt.read_pointer(bucket, "r")
    assert ref is not None
    return ref


def params(model) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def test_the_step_goes_on_while_the_write_runs_and_the_checkpoint_holds_the_steps_state(trainer, monkeypatch):
    t = trainer
    ckpt.save_checkpoint(t.bucket, "r", t.policy.model, t.opt, version=1, step=0)  # the previous checkpoint
    before, at_step = t.bucket.get(checkpoint_pointer_key("r")), params(t.policy.model)
    gate = Gate(t.bucket, monkeypatch)
    t0 = time.perf_counter()
    assert t.ops.save(2, 1) == 0 and t.ops.writer.in_flight()  # returned with the write still held
    assert time.perf_counter() - t0 < 5
    with torch.no_grad():  # the next step moves the weights while the write runs
        for p in t.policy.model.parameters():
            p.add_(1.0)
    assert gate.waiting.wait(30)  # the write has its files ready and waits to upload the first
    assert t.bucket.get(checkpoint_pointer_key("r")) == before  # not named until its files are in
    fresh = open_bucket(t.bucket.url)
    assert (pointer(fresh).version, pointer(fresh).step) == (1, 0)
    gate.open()
    t.ops.settle_save()
    restored = ckpt.load_checkpoint(fresh, "r", t.policy.model, t.opt)
    assert restored is not None and (restored.version, restored.step) == (2, 1)
    after = params(t.policy.model)
    assert all(torch.equal(after[k], at_step[k]) for k in at_step)  # the snapshot, not the moved weights


def test_at_most_one_write_in_flight_the_next_checkpoint_waits(trainer, monkeypatch):
    t = trainer
    gate = Gate(t.bucket, monkeypatch)
    t.ops.save(2, 1)
    second = threading.Thread(target=t.ops.save, args=(3, 2))
    second.start()
    time.sleep(0.5)
    assert second.is_alive()  # waiting for the first write, its snapshot not taken yet
    assert gate.keys == []
    gate.open()
    second.join(30)
    t.ops.settle_save()
    tags = [k.split("/")[-2] for k in gate.keys]
    first_tag, n = tags[0], tags.count(tags[0])
    assert set(tags[:n]) == {first_tag} and first_tag not in tags[n:]  # the first write's files, then the second's
    ref = pointer(t.bucket)
    assert (ref.version, ref.step) == (3, 2) and ref.tag != first_tag


def test_the_pointer_waits_for_the_weights_pointer_it_claims(trainer, monkeypatch):
    t = trainer
    released, real = threading.Event(), t.publisher.publish

    def slow_publish(version, state):
        assert released.wait(30)
        return real(version, state)

    monkeypatch.setattr(t.publisher, "publish", slow_publish)
    with torch.no_grad():
        for p in t.policy.model.parameters():
            p.add_(0.01)
    t.version, t.step = 2, 1
    t.start_publish(2)  # v2's upload is held
    t.checkpoint()
    files = checkpoint_files_prefix("r")
    deadline = time.monotonic() + 20
    while not any(i.key.endswith(".metadata") for i in t.bucket.list(files)) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    assert ckpt.read_pointer(t.bucket, "r") is None  # files in, pointer held: v2 is not published yet
    released.set()
    t.settle_publish()
    t.settle_checkpoint()
    assert pointer(t.bucket).version == 2


def test_a_failed_upload_of_its_version_leaves_the_checkpoint_unnamed(trainer, monkeypatch):
    t = trainer

    def broken(version, state):
        raise ValueError("upload refused")

    monkeypatch.setattr(t.publisher, "publish", broken)
    t.version, t.step = 2, 1
    t.start_publish(2)
    t.checkpoint()
    with pytest.raises(ValueError, match="upload refused"):
        t.settle_checkpoint()
    assert ckpt.read_pointer(t.bucket, "r") is None


def test_the_run_waits_for_the_last_write_before_it_reads_finished(trainer, monkeypatch):
    from tests.test_trainer_overlap import entries

    t, order = trainer, []
    real_put, real_put_file = t.bucket.put, t.bucket.put_file

    def slow_put_file(key, path, **kw):
        time.sleep(0.4)  # a slow bucket: the write outlasts the last step
        return real_put_file(key, path, **kw)

    def put(key, data, **kw):
        if key == checkpoint_pointer_key("r"):
            order.append("checkpoint pointer")
        if key == status_key("r") and b'"finished"' in data:
            order.append("finished")
        return real_put(key, data, **kw)

    monkeypatch.setattr(t.bucket, "put_file", slow_put_file)
    monkeypatch.setattr(t.bucket, "put", put)
    t.open_lifecycle()
    t.last_step_at = 0.0
    t.resume = lambda: None

    def two_steps() -> int:
        for k in range(2):
            t.train(entries(k))
        return 2

    t.loop = two_steps
    t.run()
    assert order == ["checkpoint pointer", "finished"]
    assert not t.ops.writer.in_flight() and pointer(t.bucket).step == 2


def test_a_failed_write_surfaces_at_the_next_checkpoint(trainer, monkeypatch):
    t = trainer

    def refuses(key, path, **kw):
        raise ValueError("disk full")

    monkeypatch.setattr(t.bucket, "put_file", refuses)
    t.ops.save(2, 1)
    with pytest.raises(ValueError, match="disk full"):
        t.ops.save(3, 2)
