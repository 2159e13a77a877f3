"""Cold-start demonstrations become rows exactly as episodes have them; a bad JSONL line stops with file:line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stoa.envs.base import observation_tokens
from stoa.episodes.task_tools import open_task_tools
from stoa.rollouts.episode import ROLE_ACTION, ROLE_ECHO
from stoa.tasks import get_task
from stoa.tasks.arithmetic import ArithmeticTask
from stoa.tokenize import TextCodec
from stoa.trainer.coldstart import ColdStartError, build_rows, load_conversations


@pytest.fixture(scope="module")
def codec(tiny_dir) -> TextCodec:
    return TextCodec(tiny_dir)


@pytest.fixture(scope="module")
def search():
    task = get_task("search", entities=40)
    return task, open_task_tools(task, role="test", corpus="memory", note=lambda *_: None).tools


def test_search_demos_carry_the_environments_own_observation_and_earn_full_reward(codec, search):
    task, tools = search
    demos = task.demonstrations(12, np.random.default_rng(0))
    rows, dropped = build_rows(demos, task, codec, tools, 64, strict=False)
    assert len(rows) + dropped == 12 and len(rows) >= 6
    kept = [d for d in demos if d.evidence and any(d.evidence.lower() in r.text.lower()
                                                   for r in tools.run([task.make_env(d.prompt, 0).parse(d.turns[0])]))]
    assert len(kept) == len(rows)
    for demo, row in zip(kept, rows, strict=True):
        first = codec.encode_text(demo.turns[0])
        env = task.make_env(demo.prompt, 0)
        call = env.parse(demo.turns[0])
        want, want_roles = observation_tokens(env.observe(call, tools.run([call])[0]), codec)
        b = len(first)
        assert row.tokens[:b].tolist() == first and set(row.roles[:b].tolist()) == {ROLE_ACTION}
        assert row.tokens[b : b + len(want)].tolist() == want and row.roles[b : b + len(want)].tolist() == want_roles
        assert ROLE_ECHO in want_roles
        last = row.tokens[b + len(want):]
        assert set(row.roles[b + len(want):].tolist()) == {ROLE_ACTION}
        assert task.reward(demo.prompt, codec.decode(first) + "\n" + codec.decode(last)) == 1.0
        assert row.prompt.tolist() == codec.encode_prompt(demo.prompt.messages)


def test_arithmetic_demo_is_the_answer_then_eos(codec):
    task = ArithmeticTask()
    demos = task.demonstrations(4, np.random.default_rng(1))
    rows, dropped = build_rows(demos, task, codec, None, 16, strict=True)
    assert dropped == 0
    for demo, row in zip(demos, rows, strict=True):
        assert row.tokens[-1] in codec.eos_ids and task.is_correct(demo.prompt, codec.decode(row.tokens))
        assert set(row.roles.tolist()) == {ROLE_ACTION}


def _line(*turns: str, tool: tuple[str, ...] = (), question: str = "Q?") -> str:
    msgs = [{"role": "user", "content": question}]
    for k, t in enumerate(turns):
        msgs.append({"role": "assistant", "content": t})
        if k < len(tool):
            msgs.append({"role": "tool", "content": tool[k]})
    return json.dumps({"messages": msgs})


def test_a_malformed_or_misshapen_jsonl_line_is_refused_naming_the_file_and_line(tmp_path):
    path = tmp_path / "demos.jsonl"
    for bad in ("{not json", json.dumps({"messages": "hi"}), json.dumps({"messages": [{"role": "user"}]}),
                json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}]})):
        path.write_text(_line("42") + "\n\n" + bad + "\n")
        with pytest.raises(ColdStartError, match=rf"{path}:3: .*fix or remove the line"):
            load_conversations(path, 1)  # every line is checked, not only the ones kept
    path.write_text(_line("42") + "\n" + _line("7") + "\n")
    assert [d.turns for d in load_conversations(path, 5)] == [("42",), ("7",)]
    assert load_conversations(path, 5)[1].source == f"{path}:2"


def test_a_conversation_over_the_limits_or_with_forged_tool_results_is_refused_with_its_line(tmp_path, codec, search):
    task, tools = search
    q = task.world.train[0]
    good_call = f"<search> {q.text} </search>"
    real = tools.run([task.make_env(task.get("train:0"), 0).parse(good_call)])[0].text
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([
        _line(good_call, f"<answer> {q.golds[0]} </answer>", tool=(real,)),
        _line(good_call, f"<answer> {q.golds[0]} </answer>", tool=("Doc 1(Title: X) forged document",)),
        _line(good_call, "<answer> " + "word " * 200 + "</answer>", tool=(real,)),
    ]) + "\n")
    demos = load_conversations(path, 3)
    rows, _ = build_rows(demos[:1], task, codec, tools, 64, strict=True)
    assert len(rows) == 1
    with pytest.raises(ColdStartError, match=rf"{path}:2: .*differs from what the trainer's tools return"):
        build_rows(demos[:2], task, codec, tools, 64, strict=True)
    with pytest.raises(ColdStartError, match=rf"{path}:3: turn 1 is \d+ tokens, over max_new_tokens = 64"):
        build_rows(demos[2:], task, codec, tools, 64, strict=True)


def test_walk_demos_are_the_shortest_walks_built_without_drops_and_scored_correct(codec):
    from stoa.envs.base import episode_text
    from stoa.tasks.walk import WalkTask

    task = WalkTask(size=6, max_turns=8)
    tools = task.make_tools()
    demos = task.demonstrations(16, np.random.default_rng(2))
    rows, dropped = build_rows(demos, task, codec, tools, 16, strict=True)
    assert dropped == 0 and len(rows) == 16
    for demo, row in zip(demos, rows, strict=True):
        start, goal = task.problem(demo.prompt.id)
        assert len(demo.turns) == abs(goal - start) + 1  # one move per step, then the answer
        text = episode_text(row.tokens.tolist(), row.roles.tolist(), codec.decode)
        assert task.is_correct(demo.prompt, text) and task.final_position(demo.prompt, text) == goal
        assert codec.decode(row.tokens).rstrip().endswith(f"position {goal}</state>\n<answer>done</answer>".strip())
