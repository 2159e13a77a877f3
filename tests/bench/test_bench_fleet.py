"""`stoa bench fleet` at tiny scale: the counters it reports agree with what the pool really did."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from stoa.bench.fleet import Scenario, add_arguments, main, make_run, run_scenario
from stoa.bucket import open_bucket


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--groups-per-step", "2", "--step-seconds", "60", "--groups-per-min", "1", *argv])


@pytest.fixture(scope="module")
def run(tiny_dir):
    return make_run("toy")


def _counters(steps):
    return [(s.new_records, s.polls, s.lists, s.gets) for s in steps]


def test_gets_are_new_records_lists_are_polls_times_versions_and_idle_workers_cost_nothing(run, tmp_path):
    args = _args("--steps", "2")
    busy = run_scenario(Scenario("local", 5, 0, 1), open_bucket(str(tmp_path / "a")), run, args)
    assert len(busy) == 2
    for s in busy:
        assert s.new_records > 0 and s.gets == s.new_records  # every new record read once, nothing else
        assert s.lists == s.polls * 2  # one page per version of the window [v-1, v]
        assert s.list_s > 0 and s.get_s > 0 and s.check_s > 0 and s.wall_s >= 60
    idle = run_scenario(Scenario("local", 5, 50, 1), open_bucket(str(tmp_path / "b")), run, args)
    assert _counters(idle) == _counters(busy)


def test_waiting_polls_list_the_window_each_time(run, tmp_path):
    # 2 workers x 1 group/min cannot feed 4 groups per 10 s step: the trainer waits, polling every 0.5 s.
    args = _args("--steps", "1", "--groups-per-step", "4", "--step-seconds", "10", "--reuse-cap", "1")
    (step,) = run_scenario(Scenario("local", 2, 0, 2), open_bucket(str(tmp_path / "b")), run, args)
    assert step.polls > 1
    assert step.lists == step.polls * 3
    assert step.gets == step.new_records >= 1


def test_main_on_local_and_moto_appends_rows(run, tmp_path):
    out = tmp_path / "fleet.jsonl"
    assert main(_args("--workers", "3", "--windows", "1", "--steps", "1", "--s3", "--out", str(out))) == 0
    rows = [json.loads(line) for line in Path(out).read_text().splitlines()]
    assert [(r["backend"], r["workers"], r["window"]) for r in rows] == [("local", 3, 1), ("s3", 3, 1)]
    assert rows[0]["gets"] == rows[0]["new_records"] and rows[1]["gets"] == rows[1]["new_records"]
    assert all(r["lists"] == 2 * r["polls"] and 0 < r["intake_share"] < 1 for r in rows)
