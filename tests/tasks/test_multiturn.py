"""The multi-turn task protocol: which tasks are multi-turn, their limits, local tools, import hygiene."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stoa.envs.base import Tools, result_hash
from stoa.rollouts.episode import EpisodeLimits, ToolCall
from stoa.tasks import TASKS, get_task, is_multiturn
from stoa.tasks.multiturn import LocalTools, MultiTurnTask, episode_limits, limits_spec, task_limits


@pytest.mark.parametrize(("name", "multi"), [("search", True), ("walk", True), ("arithmetic", False),
                                             ("toy", False)])
def test_is_multiturn(name: str, multi: bool) -> None:
    task = get_task(name)
    assert is_multiturn(task) is multi
    assert isinstance(task, MultiTurnTask) is multi


def test_is_multiturn_wants_every_part() -> None:
    class Half:
        limits = EpisodeLimits()
        tool_kind = "search"

        def make_env(self, prompt, seed):
            return None

    assert not is_multiturn(Half())
    Half.make_tools = lambda self, searcher: None  # type: ignore[attr-defined]
    assert is_multiturn(Half())
    Half.tool_kind = "web"
    assert not is_multiturn(Half())


def test_every_registered_multiturn_task_declares_its_limits() -> None:
    for name in ("search", "searchqa", "walk"):
        options = TASKS[name].OPTIONS
        assert {k: options[k] for k in ("max_turns", "max_obs_tokens", "max_total_tokens")} == {
            "max_turns": int, "max_obs_tokens": int, "max_total_tokens": int}
        assert "max_turn_tokens" not in options  # the contract's max_new_tokens


def test_episode_limits_take_the_turn_cap_from_the_contract() -> None:
    task = get_task("walk", max_turns=3)
    assert is_multiturn(task)
    limits = episode_limits(task, 77)  # type: ignore[arg-type]
    assert limits == EpisodeLimits(max_turns=3, max_turn_tokens=77, max_obs_tokens=32, max_total_tokens=512)
    assert limits_spec(limits) == {"max_turns": 3, "max_obs_tokens": 32, "max_total_tokens": 512}


@pytest.mark.parametrize("name", ["max_turns", "max_obs_tokens", "max_total_tokens"])
def test_task_limits_name_the_option(name: str) -> None:
    values = {"max_turns": 2, "max_obs_tokens": 8, "max_total_tokens": 64, name: 0}
    with pytest.raises(ValueError, match=f"walk: option '{name}' must be >= 1"):
        task_limits("walk", **values)


def test_local_tools_echo_the_argument() -> None:
    tools = LocalTools()
    assert isinstance(tools, Tools)
    calls = [ToolCall("move", "left"), ToolCall("move", "right"), ToolCall("other", "left")]
    results = tools.run(calls)
    assert [r.text for r in results] == ["left", "right", "left"]
    assert results[0].digest == result_hash(["move", "left"]) != results[2].digest
    assert tools.run([]) == []


def test_tasks_import_no_backend_and_no_optional_packages() -> None:
    code = ("import sys, stoa.tasks; stoa.tasks.get_task('search', entities=20); stoa.tasks.get_task('walk'); "
            "print([m for m in ('torch', 'mlx', 'pyarrow', 'bm25s', 'datasets') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
