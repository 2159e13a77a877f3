"""Progress and stalls: the trainer's ``step N/T`` lines with rate and ETA, the status's target, uniform groups
that count against backpressure (and the one line that names the fix), and the status write when the want
reaches zero."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stoa.bucket import open_bucket
from stoa.lifecycle import read_status
from stoa.schemas.control import RunStatus
from stoa.trainer.demand import StatusPublisher, UniformSkips, wanted_groups
from stoa.trainer.loop import _Trainer
from stoa.trainer.steplog import Progress, StepClock


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_step_clock_measures_the_rate_over_recent_steps_and_the_eta_to_the_total():
    clock = Clock()
    c = StepClock(30, step=10, window=3, clock=clock)  # a resumed run at step 10: its earlier steps are not timed
    clock.t = 6.0
    assert c.tick(11) == Progress(11, 30, 10.0, 114.0)  # 1 step in 6 s: 10/min, 19 steps left
    for step in (12, 13, 14):
        clock.t += 2.0
        p = c.tick(step)  # the window holds steps 11..14 (3 intervals of 2 s): the slow first step fell out
    assert p.per_min == pytest.approx(30.0) and p.eta_s == pytest.approx(32.0)
    unbounded = StepClock(0, step=0, clock=clock)
    clock.t = 18.0
    assert unbounded.tick(1) == Progress(1, 0, 10.0, None)


def test_a_step_line_says_n_of_t_with_rate_and_eta_and_no_eta_when_unbounded():
    assert Progress(3, 30, 5.2, 310.0).text() == "step 3/30 (5.2 steps/min, ETA 5m10s)"
    assert Progress(3, 0, 5.2, None).text() == "step 3 (5.2 steps/min)"
    assert Progress(1, 30).text() == "step 1/30"


def test_skipped_groups_reduce_the_want_until_forgiven_and_a_step_starts_over():
    window = 4 * (3 + 1)
    assert wanted_groups(4, 3, available=2, skipped=0) == 14
    assert wanted_groups(4, 3, available=2, skipped=10) == 4
    assert wanted_groups(4, 3, available=2, skipped=20) == 0
    clock = Clock()
    skips = UniformSkips(window, forgive_s=30.0, clock=clock)
    assert skips.counted(12, step=0) == 12
    clock.t = 29.0
    assert skips.counted(16, step=0) == 16  # a whole window read, none trained: the want is 0
    clock.t = 30.0
    assert skips.counted(16, step=0) == 0  # forgiven: one more window for a policy that may still find signal
    assert skips.counted(20, step=0) == 4
    assert skips.counted(3, step=1) == 3  # a step: the pool's count starts over, so does this one


def test_the_fix_is_named_once_after_a_whole_window_was_skipped():
    skips = UniformSkips(16)
    assert skips.note(0, 20, version=1) is None  # nothing skipped: not a stall
    assert skips.note(8, 4, version=1) is None  # less than a window read
    line = skips.note(12, 4, version=1)
    assert line is not None and "skip_uniform_groups = false" in line and "cold start" in line
    assert skips.note(40, 0, version=1) is None  # once


def _beat_trainer(tmp_path, skipped: int, available: int, step: int = 0):
    """A trainer's ``beat`` on a real status publisher, its pool replaced by counts."""
    bucket = open_bucket(str(tmp_path / "b"))
    lines: list[str] = []
    t = SimpleNamespace(
        cfg=SimpleNamespace(groups_per_step=4, staleness_bound=3, backpressure=True),
        pool=SimpleNamespace(stats=SimpleNamespace(skipped_uniform=skipped), available=lambda: available,
                           entries={}),
        skips=UniformSkips(16), run_status=StatusPublisher(bucket, "r", 10.0, target_steps=30), version=1,
        step=step, last_step_s=0.0, retention=SimpleNamespace(kept_from=1), echo=lines.append)
    _Trainer.beat(t)  # type: ignore[arg-type]
    status = read_status(bucket, "r")
    assert status is not None
    return status, lines


def test_the_trainers_published_want_counts_its_skipped_groups(tmp_path):
    fresh, quiet = _beat_trainer(tmp_path / "a", skipped=0, available=2)
    stalled, said = _beat_trainer(tmp_path / "b", skipped=14, available=2)
    assert (fresh.wanted_groups, stalled.wanted_groups) == (14, 0)
    assert quiet == [] and len(said) == 1 and "skip_uniform_groups = false" in said[0]
    assert (stalled.step, stalled.target_steps) == (0, 30)


def test_the_status_is_rewritten_at_once_when_the_want_reaches_zero_or_rises(tmp_path):
    bucket, mono = open_bucket(str(tmp_path)), Clock()
    pub = StatusPublisher(bucket, "r", 10.0, mono=mono, target_steps=5)
    assert pub.beat(1, 8, step_s=0.0, kept_from=1)
    mono.t = 1.0
    assert not pub.beat(1, 3, step_s=0.0, kept_from=1)  # same version, heartbeat not due, the want fell
    assert pub.beat(1, 0, step_s=0.0, kept_from=1)  # workers must pause now, not at the next heartbeat
    assert not pub.beat(1, 0, step_s=0.0, kept_from=1)
    assert pub.beat(1, 2, step_s=0.0, kept_from=1)  # groups left the pool: a new want at once
    assert not pub.beat(1, 1, step_s=0.0, kept_from=1)
    assert pub.beat(1, 16, step_s=0.0, kept_from=1, step=2)
    status = read_status(bucket, "r")
    assert status is not None and (status.wanted_groups, status.step, status.target_steps) == (16, 2, 5)


def test_status_progress_fields_round_trip_and_an_older_status_reads_without_a_target():
    s = RunStatus("running", 7, 1.5, 1.5, 0, 2.0, 4, 6, 30)
    assert RunStatus.from_json(s.to_json()) == s
    older = s.to_json().replace(b', "step": 6', b"").replace(b', "target_steps": 30', b"")
    assert RunStatus.from_json(older) == RunStatus("running", 7, 1.5, 1.5, 0, 2.0, 4, 0, None)
    for bad in (b'"target_steps": -1', b'"target_steps": "30"', b'"target_steps": 1.5', b'"target_steps": true'):
        assert RunStatus.from_json(s.to_json().replace(b'"target_steps": 30', bad)) is None, bad
    assert RunStatus.from_json(s.to_json().replace(b'"step": 6', b'"step": -2')) is None
