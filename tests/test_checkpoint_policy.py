"""Checkpoints sized for a bucket that bills: when they are written, how many are kept, what each costs."""

from __future__ import annotations

import json

import pytest

from stoa.bucket import open_bucket
from stoa.layout import checkpoint_files_prefix, checkpoint_pointer_key
from stoa.trainer import checkpoint as ckpt
from stoa.trainer.cadence import CheckpointCadence, cadence_lines, checkpoint_bytes, per_hour
from tests.test_trainer_resume import make_cfg


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_cadence_by_minutes_by_steps_and_at_the_end():
    clock = Clock()
    c = CheckpointCadence(every_steps=0, minutes=30.0, clock=clock)
    clock.t += 29 * 60
    assert not c.due(1)
    clock.t += 60
    assert c.due(2)
    c.saved(2)
    clock.t += 60
    assert not c.due(3) and c.final_due(3, steps_here=3) and not c.final_due(2, steps_here=2)
    assert not c.final_due(3, steps_here=0)  # a trainer that took no step has nothing new to save
    s = CheckpointCadence(every_steps=4, minutes=0.0, clock=clock)
    clock.t += 10 ** 6
    assert [k for k in range(1, 13) if s.due(k)] == [4, 8, 12]


def test_bytes_per_hour_at_a_step_rate():
    cfg = make_cfg("b")  # the defaults: every 30 minutes, keep 1
    assert per_hour(cfg, 18.4) == 2.0
    assert per_hour(make_cfg("b", checkpoint_every=1, checkpoint_minutes=0.0), 18.4) == pytest.approx(3600 / 18.4)
    assert per_hour(make_cfg("b", checkpoint_every=0, checkpoint_minutes=0.0), 18.4) == 0.0
    assert per_hour(make_cfg("b", checkpoint_minutes=0.1), 60.0) == 60.0  # never more than one a step
    lines = cadence_lines(cfg, 134_515_008)
    assert "checkpoint size = 1.61 GB" in lines[1] and "3.23 GB at 10 s/step" in lines[2]


@pytest.fixture
def trainer(tmp_path, stoa_cache):
    from stoa.trainer.loop import _Trainer

    t = _Trainer(make_cfg(str(tmp_path / "b")), echo=lambda *_: None)
    t.resume()
    yield t
    t.close()


def _tags(bucket, run="r") -> set[str]:
    head = checkpoint_files_prefix(run)
    return {info.key[len(head):].split("/", 1)[0] for info in bucket.list(head)}


def test_a_checkpoint_is_12_bytes_per_parameter_plus_small_headers(trainer):
    model = trainer.policy.model
    params = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    loss = sum((p.float() ** 2).sum() for p in model.parameters())
    loss.backward()
    trainer.opt.step()  # AdamW's moments exist
    written = ckpt.save_checkpoint(trainer.bucket, "r", model, trainer.opt, version=1, step=1)
    # DCP adds ~2 KB of headers per tensor saved: each parameter, its two moments and its step count
    assert checkpoint_bytes(params) <= written <= checkpoint_bytes(params) + 4 * 4096 * tensors


def test_keep_k_keeps_the_newest_k_and_drops_half_written_ones(trainer):
    bucket, model, opt = trainer.bucket, trainer.policy.model, trainer.opt
    refs = []
    for step in range(1, 5):
        ckpt.save_checkpoint(bucket, "r", model, opt, version=step, step=step, keep=2)
        refs.append(ckpt.read_pointer(bucket, "r"))
    assert refs[-1].kept == (refs[-2].tag,) and _tags(bucket) == {refs[-1].tag, refs[-2].tag}
    stray = checkpoint_files_prefix("r", "s0000000009-deadbeef") + ".metadata"  # a killed trainer's, never named
    bucket.put(stray, b"x")
    ckpt.save_checkpoint(bucket, "r", model, opt, version=5, step=5, keep=1)
    last = ckpt.read_pointer(bucket, "r")
    assert last.kept == () and _tags(bucket) == {last.tag}


def test_a_kill_mid_write_leaves_the_previous_checkpoint_named_and_loadable(trainer, monkeypatch):
    bucket, model, opt = trainer.bucket, trainer.policy.model, trainer.opt
    ckpt.save_checkpoint(bucket, "r", model, opt, version=1, step=1)
    before = bucket.get(checkpoint_pointer_key("r"))
    real = bucket.put_file
    calls = []

    def dies(key, path, **kw):
        calls.append(key)
        if len(calls) > 1:
            raise KeyboardInterrupt  # the process dies after the first file of the new checkpoint
        return real(key, path, **kw)

    monkeypatch.setattr(bucket, "put_file", dies)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(bucket, "r", model, opt, version=2, step=2)
    monkeypatch.undo()
    assert bucket.get(checkpoint_pointer_key("r")) == before
    restored = ckpt.load_checkpoint(open_bucket(bucket.url), "r", model, opt)
    assert restored is not None and (restored.version, restored.step) == (1, 1)


def test_an_old_pointer_without_kept_still_reads_and_a_bad_kept_is_refused():
    ref = ckpt.CheckpointRef("s0000000001-0a0b0c0d", 1, 1, 1, {".metadata": 3})
    old = json.loads(ref.to_json())
    del old["kept"]
    assert ckpt.CheckpointRef.from_json(json.dumps(old).encode()).kept == ()
    with pytest.raises(ckpt.CheckpointError):
        ckpt.CheckpointRef.from_json(json.dumps({**old, "kept": ["../../x"]}).encode())


def test_the_run_end_saves_the_last_step_once(trainer, monkeypatch):
    from tests.test_trainer_overlap import entries

    t = trainer
    saves: list[int] = []
    real = t.ops.save
    monkeypatch.setattr(t.ops, "save", lambda version, step: (saves.append(step), real(version, step))[1])
    t.open_lifecycle()
    t.last_step_at = 0.0
    t.resume = lambda: None  # already resumed (v1) by the fixture

    def two_steps_then_a_stop() -> int:  # what loop() does when SIGTERM arrives after two steps
        for k in range(2):
            t.train(entries(k))
        return 2

    t.loop = two_steps_then_a_stop
    t.run()
    ref = ckpt.read_pointer(t.bucket, "r")
    assert saves == [2] and (ref.step, ref.version) == (2, 3)  # by time: none due in a few seconds; the end: one
