"""The walk toy env: prompts by id, local tools, recurring states, and the reward replaying the moves."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from stoa.envs.base import Environment, ToolResult, result_hash
from stoa.rollouts.episode import ROLE_ECHO, ROLE_MASKED, EpisodeLimits, ToolCall
from stoa.tasks import PromptIdError, WalkTask, get_task, is_multiturn
from stoa.tasks.multiturn import LocalTools, MultiTurnTask, episode_limits
from stoa.tasks.walk import WalkEnv

from .conftest import play, text_of


def _moves(start: int, goal: int) -> list[str]:
    step = "right" if goal > start else "left"
    return [f"<move>{step}</move>"] * abs(goal - start)


def test_prompts_by_id() -> None:
    task = WalkTask()
    assert is_multiturn(task) and isinstance(task, MultiTurnTask) and task.tool_kind == "local"
    for pid in ["train:0", "train:123456", "test:0", "test:9"]:
        p = task.get(pid)
        start, goal = task.problem(pid)
        assert p.id == pid and p == WalkTask().get(pid) and p.answer == str(goal)
        assert 0 <= start < 5 and 0 <= goal < 5 and start != goal
        assert f"at position {start}" in p.messages[0]["content"]
    pairs = {task.problem(f"train:{i}") for i in range(400)}
    assert len(pairs) == 20  # every (start, goal) with start != goal on a line of 5
    assert [task.problem(f"train:{i}") for i in range(20)] != [WalkTask(seed=1).problem(f"train:{i}")
                                                               for i in range(20)]
    rng = np.random.default_rng(0)
    assert all(task.sample_train(rng).id.startswith("train:") for _ in range(20))
    assert [p.id for p in task.heldout(3)] == ["test:0", "test:1", "test:2"]
    with pytest.raises(PromptIdError):
        task.get("walk:0")


def test_spec_round_trip_and_options() -> None:
    task = get_task("walk", size="7", max_turns="10", seed="2")
    spec = task.spec()
    assert json.loads(json.dumps(spec)) == spec
    assert spec == {"size": 7, "seed": 2, "prompt_version": 1, "max_turns": 10, "max_obs_tokens": 32,
                    "max_total_tokens": 512}
    assert get_task("walk", **spec).get("train:4") == task.get("train:4")
    assert isinstance(task, WalkTask) and task.limits == EpisodeLimits(max_turns=10, max_obs_tokens=32,
                                                                       max_total_tokens=512)
    for bad, name in [({"size": 1}, "size"), ({"max_obs_tokens": 0}, "max_obs_tokens"), ({"x": 1}, "x")]:
        with pytest.raises(ValueError, match=f"'{name}'"):
            get_task("walk", **bad)


@pytest.mark.parametrize(
    ("turn", "call"),
    [("<move>left</move>", ToolCall("move", "left")),
     ("I go <move> Right </move>", ToolCall("move", "right")),
     ("<move>up</move>", None),
     ("<move>left<move>right</move>", ToolCall("move", "right")),
     ("<answer>done</answer>", None),
     ("<move>left", None)],
)
def test_env_parse(turn: str, call: ToolCall | None) -> None:
    assert WalkEnv(2, 5).parse(turn) == call


def test_env_observe_clamps_and_states_are_positions() -> None:
    env = WalkEnv(0, 3)
    assert isinstance(env, Environment) and env.initial_state() == "position 0"
    tools = LocalTools()
    seen = []
    for arg in ["left", "right", "right", "right", "left"]:
        call = ToolCall("move", arg)
        (result,) = tools.run([call])
        assert result == ToolResult(arg, result_hash(["move", arg]))
        obs = env.observe(call, result)
        seen.append(obs.state)
        assert obs.segments == (("\n<state>", ROLE_MASKED), (obs.state, ROLE_ECHO), ("</state>\n", ROLE_MASKED))
    assert seen == ["position 0", "position 1", "position 2", "position 2", "position 1"]
    assert env.initial_state() == "position 0"


def test_reward_table() -> None:
    task = WalkTask()
    pid = next(f"train:{i}" for i in range(1000) if task.problem(f"train:{i}") == (1, 3))
    p = task.get(pid)
    ok = "\n".join(_moves(1, 3) + ["<answer>done</answer>"])
    cases = {
        ok: 1.0,
        "\n".join(_moves(1, 3) + ["I think I am there. <answer>yes</answer>"]): 1.0,  # any answer span ends it
        "\n".join(_moves(1, 3)): 0.0,  # the last move was never observed (max_turns / budget): no answer
        "\n".join(_moves(1, 4) + ["<answer>done</answer>"]): 0.0,  # overshoots to 4
        "\n".join(_moves(1, 4) + ["<move>left</move>", "<answer>done</answer>"]): 1.0,  # and comes back
        "\n".join(["<move>left</move>"] * 5 + _moves(0, 3) + ["<answer>done</answer>"]): 1.0,  # clamped at 0
        "\n".join(["<move>up</move>", "<answer>done</answer>"]): 0.0,  # an invalid move ended the episode
        "\n".join(["<move>up</move>"] + _moves(1, 3) + ["<answer>done</answer>"]): 0.0,  # nothing after it counts
        "<answer>done</answer>": 0.0,  # still at 1
        "": 0.0,
        "The goal is 3. <answer>3</answer>": 0.0,
    }
    for text, want in cases.items():
        assert task.reward(p, text) == want, text
        assert task.is_correct(p, text) is (want == 1.0)


def test_episodes_through_the_driver_recur_states() -> None:
    task = WalkTask(max_turns=4)
    pid = next(f"train:{i}" for i in range(1000) if task.problem(f"train:{i}") == (2, 4))
    p = task.get(pid)
    scripts = [
        _moves(2, 4) + ["<answer>done</answer>"],  # right, right, answer: reward 1
        ["<move>right</move>", "<move>left</move>", "<move>right</move>", "<move>right</move>"],  # max_turns
        ["<move>left</move>", "<answer>done</answer>"],  # wrong place
        ["<move>right</move>", "hmm"],  # a turn without a call ends the episode
    ]
    limits = replace(episode_limits(task, 32), max_obs_tokens=64)  # one token per character here
    eps = play([task.make_env(p, s) for s in range(4)], task.make_tools(None), scripts, limits, n=4)
    assert [ep.end_reason for ep in eps] == ["stop", "max_turns", "stop", "stop"]
    assert [task.reward(p, text_of(ep)) for ep in eps] == [1.0, 0.0, 0.0, 0.0]
    assert eps[0].states == ["position 2", "position 3", "position 4"]
    assert eps[1].states == ["position 2", "position 3", "position 2", "position 3"]
    # Anchor states recur across rows and turns: "position 3" is the state of four turns in this group.
    assert sum(ep.states.count("position 3") for ep in eps) == 4
    assert all(len(ep.states) == len(ep.turn_starts) for ep in eps)
