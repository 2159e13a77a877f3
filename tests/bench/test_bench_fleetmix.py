"""`stoa bench fleet --mix` at tiny scale: its figures add up, and pacing by speed lands the slow workers' groups
inside the window where equal shares let them go stale."""

from __future__ import annotations

from stoa.bench.fleetmix import MixSettings, parse_classes, rows, simulate


def test_pacing_by_speed_trains_the_slow_workers_groups(tiny_dir, tmp_path):
    classes = parse_classes("fast:1:30:8,slow:6:1.5:8")  # 39 groups/min against a trainer of 36
    got = {}
    for pacing in (False, True):
        sim = simulate(MixSettings(classes, pacing, steps=12, groups_per_step=12), tmp_path / str(pacing))
        got[pacing] = {r["class"]: r for r in rows(sim)}
        for r in got[pacing].values():
            assert r["sampled"] == r["trained"] + r["late"] + r["stale"] + r["pending"], r
        assert sim.step == 12
    before, after = got[False], got[True]
    assert before["slow"]["late"] > 0.5 * before["slow"]["sampled"], before["slow"]  # batches of 8 at 1.5/min
    assert after["slow"]["trained_share"] >= 0.9 and after["all"]["trained_share"] >= 0.9, after
