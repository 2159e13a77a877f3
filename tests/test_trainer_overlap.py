"""While a step computes, the next step's intake runs and the last version uploads; the order of writes stays:
each version's pointer before the next journal, each journal before its version's pointer."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest

from stoa.layout import rollout_key
from stoa.trainer import checkpoint as ckpt
from tests.test_lifecycle import make_trainer_cfg
from tests.test_trainer_step import make_entries


def entries(seed: int):
    return [dataclasses.replace(e, key=rollout_key("r", 1, "w", seed * 10 + i))
            for i, e in enumerate(make_entries(seed, groups=2, n=2))]


@pytest.fixture
def trainer(tmp_path, stoa_cache, monkeypatch):
    from stoa.trainer.loop import _Trainer

    t: Any = _Trainer(make_trainer_cfg(str(tmp_path / "b"), n_samples=2), echo=lambda *_: None)  # with .events
    t.open_lifecycle()
    t.last_step_at = 0.0  # set by loop(), which these tests drive by hand
    events: list[tuple[str, int]] = []
    real_journal, real_publish = ckpt.write_journal, t.publisher.publish

    def journal(bucket, run_id, state):
        real_journal(bucket, run_id, state)
        events.append(("journal", state["version"]))

    def publish(version, state):
        time.sleep(0.2)  # a slow upload: the next step's journal must still wait for its pointer
        out = real_publish(version, state)
        events.append(("pointer", version))
        return out

    monkeypatch.setattr(ckpt, "write_journal", journal)
    monkeypatch.setattr(t.publisher, "publish", publish)
    t.events = events
    yield t
    t.close()


def test_the_intake_runs_while_the_step_computes_and_writes_keep_their_order(trainer):
    t = trainer
    t.resume()  # publishes v1
    intake_running = threading.Event()
    refresh = t.pool.refresh

    def slow_refresh(version):
        intake_running.set()
        return refresh(version)

    t.pool.refresh = slow_refresh
    step = t.ops.step

    def step_waiting_for_the_intake(*args):
        assert intake_running.wait(10), "the intake did not run while the step computed"
        return step(*args)

    t.ops.step = step_waiting_for_the_intake
    steps_done = threading.Condition()
    done = [0]
    publish = t.publisher.publish

    def counted_step(*args):
        out = step_waiting_for_the_intake(*args)
        with steps_done:
            done[0] += 1
            steps_done.notify_all()
        return out

    def upload_slower_than_the_next_step(version, state):
        """v2 uploads from the end of step 1 until after step 2 has computed (then 0.2 s more, in publish)."""
        with steps_done:
            assert steps_done.wait_for(lambda: done[0] >= version, 20), f"no step after v{version}'s upload began"
        return publish(version, state)

    t.ops.step = counted_step
    t.publisher.publish = upload_slower_than_the_next_step
    for k in range(3):
        intake_running.clear()
        t.train(entries(k))
    with steps_done:
        done[0] += 1  # no fourth step: let v4's upload finish
        steps_done.notify_all()
    t.settle_publish()
    assert t.events == [("pointer", 1), ("journal", 2), ("pointer", 2), ("journal", 3), ("pointer", 3),
                        ("journal", 4), ("pointer", 4)]


def test_a_failed_upload_stops_the_next_step_before_its_journal(trainer):
    t = trainer
    t.resume()

    def broken(version, state):
        raise RuntimeError("encoder bug")

    t.publisher.publish = broken
    t.train(entries(0))  # v2's upload fails on its thread...
    with pytest.raises(RuntimeError, match="encoder bug"):
        t.train(entries(1))  # ...and surfaces before v3's journal is written
    assert ("journal", 3) not in t.events
