"""Which panels ``stoa plot`` draws: the search-rate panel joins (right after the eval panel) when a run logged a
held-out or training search rate, and never otherwise. Data-level (``panels_for``, ``run_curves``), no pixels."""

from __future__ import annotations

import pytest

from stoa.observe.plotdata import PANELS, SEARCH_PANEL, panels_for, run_curves

T0 = 1_700_000_000.0


def _run(run_id: str, extra: dict[str, object] | None = None, *, source: str = "trainer"):
    """A run of three step rows (reward, loss) with ``extra`` in the last, written by ``source``."""
    rows = [("trainer", {"time": T0 + v, "version": v, "train/loss": 0.1, "rollout/reward_mean": 0.1 * v})
            for v in (1, 2, 3)]
    if extra:
        rows.append((source, {"time": T0 + 9, "version": 3, **extra}))
    return run_curves(run_id, rows)


def _names(runs) -> list[str]:
    return [p.name for p in panels_for(runs)]


def test_a_run_without_search_metrics_gets_the_usual_panels():
    assert panels_for([_run("a")]) == PANELS
    assert panels_for([_run("a", {"eval/accuracy": 0.4, "eval/cover_em": 0.2})]) == PANELS
    assert panels_for([]) == PANELS


def test_a_held_out_search_rate_adds_the_panel_after_eval():
    run = _run("s", {"eval/search_rate": 0.75, "eval/cover_em": 0.1})
    names = _names([run])
    assert names[names.index("eval") + 1] == "search" and names.count("search") == 1
    assert [n for n in names if n != "search"] == [p.name for p in PANELS]
    assert [y for _, _, y in run.curves["eval/search_rate"].rows] == [0.75]


def test_a_training_search_rate_alone_adds_the_panel():
    run = _run("s", {"rollout/search_rate": 0.5})
    assert "search" in _names([run])
    assert [y for _, _, y in run.curves["rollout/search_rate"].rows] == [0.5]


def test_one_search_run_among_compared_runs_adds_the_panel_for_all():
    assert "search" in _names([_run("plain"), _run("s", {"eval/search_rate": 0.25})])


def test_forged_or_foreign_search_rates_do_not_add_the_panel():
    # a non-number, and a training metric in another writer's chunk (train/ and rollout/ are the trainer's only)
    assert "search" not in _names([_run("s", {"eval/search_rate": "high"})])
    assert "search" not in _names([_run("s", {"rollout/search_rate": 0.9}, source="worker-w")])
    assert "search" in _names([_run("s", {"eval/search_rate": 0.9}, source="eval")])  # an evaluator may write eval/*


def test_the_search_panel_draws_held_out_and_training_rates():
    assert [m.key for m in SEARCH_PANEL.metrics] == ["eval/search_rate", "rollout/search_rate"]
    assert not SEARCH_PANEL.first_only  # both curves, told apart by line style


def test_the_figure_of_a_search_run_has_the_search_panel_with_both_curves(tmp_path):
    pytest.importorskip("matplotlib", reason="stoa plot needs matplotlib (the plot extra)")
    from stoa.observe.plot import render

    run = _run("s", {"eval/search_rate": 0.75, "rollout/search_rate": 0.5})
    result = render([run], tmp_path / "s.png", width=900, height=800)
    assert [b.name for b in result.panels] == _names([run])
    search = next(b for b in result.panels if b.name == "search")
    assert search.lines == 2 and search.right > search.left and search.bottom > search.top
    plain = render([_run("a")], tmp_path / "a.png", width=900, height=700)
    assert [b.name for b in plain.panels] == [p.name for p in PANELS]
