"""The verifiers adapter (``vf:ENV``) on environments built here from tiny datasets: prompts, splits, spec
round trip, rubric rewards through ``score_group``, in-process tools played by the episode driver, bad input."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("verifiers.v1", reason="verifiers 0.4 is an optional extra (pip install 'stoa[vf]')")

from stoa.rollouts.episode import EpisodeLimits  # noqa: E402
from stoa.tasks.base import RewardError, TaskDataError, TaskOptionError, TaskPluginError  # noqa: E402
from stoa.tasks.code import task_code  # noqa: E402
from stoa.tasks.multiturn import is_multiturn  # noqa: E402
from stoa.tasks.registry import get_task, load_task  # noqa: E402
from stoa.tasks.scoring import score_group  # noqa: E402
from stoa.tasks.vf import VerifiersTask  # noqa: E402
from tests.tasks.conftest import play, text_of  # noqa: E402

_HEAD = """
import verifiers.v1 as vf

class Data(vf.TaskData):
    answer: str = ""
"""

ENVS = {
    # single turn: two weighted rewards, a typed config, a split field for eval_arg
    "vft_math": _HEAD + """
class Config(vf.TasksetConfig):
    n: int = 30
    start: int = 0
    split: str = "train"
    shout: bool = False

class MathTask(vf.Task[Data, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def exact(self, task, trace) -> float:
        return 1.0 if trace.last_reply.strip() == task.answer else 0.0

    @vf.reward(weight=0.5)
    async def short(self, trace) -> float:
        return 1.0 if len(trace.last_reply) <= 4 else 0.0

class MathTaskset(vf.Taskset[MathTask, Config]):
    def load(self):
        base = 1000 if self.config.split == "test" else 0
        for i in range(self.config.start, self.config.start + self.config.n):
            q = f"What is {base + i} + {i}?"
            yield MathTask(Data(prompt=q.upper() if self.config.shout else q, answer=str(base + 2 * i),
                                system_prompt="Answer with a number only."), self.config.task)

__all__ = ["MathTaskset"]
""",
    # multi turn: a deterministic calculator toolset
    "vft_calc": _HEAD + """
class Calculator(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    def add(self, a: int, b: int) -> int:
        \"\"\"Add two integers.\"\"\"
        return a + b

    @vf.tool
    async def boom(self, x: str) -> str:
        \"\"\"Always fails.\"\"\"
        raise RuntimeError("no " + x)

class CalcTask(vf.Task[Data, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, task, trace) -> float:
        used = any(m.content == task.answer for m in trace.tool_messages)
        return 1.0 if used and task.answer in trace.last_reply else 0.0

class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        for i in range(12):
            yield CalcTask(Data(prompt=f"Compute {i * 37} + {i * 91}.", answer=str(i * 128)), self.config.task)

__all__ = ["CalcTaskset"]
""",
    # a stateful toolset: its calls depend on earlier calls
    "vft_counter": _HEAD + """
class Count(vf.State):
    n: int = 0

class Counter(vf.Toolset[vf.ToolsetConfig, Count]):
    @vf.tool
    def tick(self) -> int:
        self.state.n += 1
        return self.state.n

class CTask(vf.Task[Data, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Counter(vf.ToolsetConfig())]

class CTaskset(vf.Taskset[CTask, vf.TasksetConfig]):
    def load(self):
        yield CTask(Data(prompt="tick"), self.config.task)

__all__ = ["CTaskset"]
""",
    # rewards that raise, or return NaN, depending on the prompt
    "vft_bad_reward": _HEAD + """
import asyncio

class BTask(vf.Task[Data, vf.State, vf.TaskConfig]):
    @vf.reward
    async def fragile(self, task, trace) -> float:
        if task.answer == "raise":
            raise KeyError("missing column")
        if task.answer == "hang":
            await asyncio.sleep(30)
        return float("nan")

class BTaskset(vf.Taskset[BTask, vf.TasksetConfig]):
    def load(self):
        for a in ("raise", "nan", "hang") * 10:
            yield BTask(Data(prompt="q", answer=a), self.config.task)

__all__ = ["BTaskset"]
""",
    # a reward that needs a sandbox runtime
    "vft_runtime": _HEAD + """
class RTask(vf.Task[Data, vf.State, vf.TaskConfig]):
    @vf.reward
    async def tests_pass(self, trace, runtime) -> float:
        return 1.0

class RTaskset(vf.Taskset[RTask, vf.TasksetConfig]):
    def load(self):
        yield RTask(Data(prompt="q"), self.config.task)

__all__ = ["RTaskset"]
""",
    # a load that needs the network, and one without data
    "vft_net": _HEAD + """
class NTaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):
    def load(self):
        raise ConnectionError("Failed to resolve 'huggingface.co'")

__all__ = ["NTaskset"]
""",
    "vft_empty": _HEAD + """
class ETaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):
    def load(self):
        return []

__all__ = ["ETaskset"]
""",
    "vft_needs_dep": "import vft_not_installed_dep\n",
}


@pytest.fixture(scope="module", autouse=True)
def envs(tmp_path_factory: pytest.TempPathFactory):
    """The environments above as modules on ``sys.path``."""
    root = tmp_path_factory.mktemp("vf_envs")
    for name, source in ENVS.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))


def _load(spec: str) -> VerifiersTask:
    """The task a spec builds, typed."""
    task = load_task(spec)
    assert isinstance(task, VerifiersTask)
    return task


def _get(**options: object) -> VerifiersTask:
    """The vf task these options build, typed."""
    task = get_task("vf", **options)
    assert isinstance(task, VerifiersTask)
    return task


def test_single_turn_prompts_splits_and_typed_args():
    task = _load("vf:vft_math,arg=n:40,arg=shout:true")
    assert not is_multiturn(task)
    assert len(task.train) + len(task.test) == 40 and 0 < len(task.test) < 12
    p = task.get("train:0")
    assert p.messages[0] == {"role": "system", "content": "Answer with a number only."}
    assert p.messages[1]["role"] == "user" and p.messages[1]["content"].startswith("WHAT IS")  # shout:true -> True
    held = task.heldout(100)
    assert len(held) == len(task.test)
    assert not {h.messages[1]["content"] for h in held} & {task.get(f"train:{i}").messages[1]["content"]
                                                          for i in range(len(task.train))}
    # the split is by each task's content, so rows removed before a row move it to no other split
    later = _load("vf:vft_math,arg=n:35,arg=start:5,arg=shout:true")
    assert [h.messages for h in held if h.messages[1]["content"] not in
            {f"WHAT IS {i} + {i}?" for i in range(5)}] == [h.messages for h in later.heldout(100)]
    assert task.sample_train(np.random.default_rng(0)).id.startswith("train:")
    with pytest.raises(ValueError, match="no held-out tasks.*raise 'heldout'"):
        _load("vf:vft_math,arg=n:5,heldout=0").heldout(1)


def test_spec_round_trips_and_refuses_other_data():
    task = _load("vf:vft_math,arg=n:20")
    spec = json.loads(json.dumps(task.spec()))
    again = _get(**spec)
    assert again.spec() == task.spec() and again.get("test:0") == task.get("test:0")
    with pytest.raises(TaskOptionError, match="option 'sha256'.*install the environment version"):
        _get(**{**spec, "sha256": "0" * 64})
    with pytest.raises(TaskOptionError, match="n_train"):
        _get(**{**spec, "arg": ["n:21"]})


def test_eval_arg_loads_the_held_out_split():
    task = _load("vf:vft_math,arg=n:10,eval_arg=split:test")
    assert len(task.train) == 10 and len(task.test) == 10
    assert task.heldout(1)[0].answer == "1000"
    assert _get(**task.spec()).sha256 == task.sha256


def test_weighted_rubric_reward_through_score_group():
    task = _load("vf:vft_math,arg=n:20")
    p = task.get("train:3")
    right, wordy, short_wrong = p.answer, f"The answer is {p.answer}.", "7"  # answers are even
    assert score_group(task, p, [right, wordy, short_wrong]) == [1.5, 0.0, 0.5]  # exact (1.0) + short (0.5)
    assert task.is_correct(p, right) and not task.is_correct(p, short_wrong)
    assert task.reward(p, "12345") == 0.0


def test_rubric_that_raises_or_returns_nan_is_a_named_reward_error():
    task = _load("vf:vft_bad_reward,heldout=0")
    raising, nan = task.get("train:0"), task.get("train:1")
    with pytest.raises(RewardError) as e:
        score_group(task, raising, ["a", "b"])
    assert e.value.reason == "reward_raised" and "missing column" in str(e.value)
    with pytest.raises(RewardError) as e:
        score_group(task, nan, ["a"])
    assert e.value.reason == "reward_not_finite"
    with pytest.raises(RewardError) as e:
        score_group(task, task.get("train:2"), ["a"], timeout_s=0.3)
    assert e.value.reason == "reward_timeout"


def test_rewards_run_from_inside_an_event_loop():
    task = _load("vf:vft_math,arg=n:20")
    p = task.get("train:1")

    async def caller() -> list[float]:
        return task.rewards(p, [p.answer, "x"])

    assert asyncio.run(caller()) == [1.5, 0.5]


def test_task_code_records_the_environment_and_verifiers():
    recorded = {c.module: c for c in task_code(_load("vf:vft_math,arg=n:5"))}
    assert set(recorded) == {"vft_math", "verifiers"}
    assert recorded["verifiers"].dist == "verifiers" and recorded["verifiers"].version.startswith("0.4")
    assert recorded["vft_math"].dist == "" and len(recorded["vft_math"].sha256) == 64


@pytest.mark.parametrize(("spec", "error", "match"), [
    ("vf:vft_missing_env", TaskPluginError, "no verifiers environment 'vft_missing_env'.*pip install "
                                            "vft_missing_env.*prime env install"),
    ("vf:vft_needs_dep", TaskPluginError, "imports 'vft_not_installed_dep'.*pip install vft_not_installed_dep"),
    ("vf:vft_net", TaskDataError, "needs the network \\(ConnectionError"),
    ("vf:vft_empty", TaskDataError, "yields no tasks"),
    ("vf:vft_math,arg=n:many", TaskOptionError, "arg=n:.*valid integer"),
    ("vf:vft_math,arg=colour:red", TaskOptionError, "arg=colour:.*Extra inputs"),
    ("vf:vft_math,arg=nocolon", TaskOptionError, "must be key:value"),
    ("vf:vft_runtime", TaskPluginError, "tests_pass needs a runtime"),
    ("vf:vft_calc", TaskOptionError, "has tools; declare tools=deterministic"),
    ("vf:vft_calc,tools=sometimes", TaskOptionError, "must be deterministic or nondeterministic"),
    ("vf:vft_counter,tools=deterministic", TaskPluginError, "per-rollout state.*stateless in-process"),
    ("vf:", TaskOptionError, "name the environment"),
])
def test_bad_input_is_one_line(spec: str, error: type, match: str):
    with pytest.raises(error, match=match) as e:
        _load(spec)
    assert "\n" not in str(e.value)


def _calc():
    task = _load("vf:vft_calc,tools=deterministic,heldout=0,max_turns=3")
    assert is_multiturn(task) and task.tool_kind == "local"
    return task


def test_tool_env_lists_tools_and_parses_text_calls():
    task = _calc()
    p = task.get("train:2")
    assert "calculator_add(a: int, b: int): Add two integers." in p.messages[0]["content"]
    env = task.make_env(p, 0)
    call = env.parse('ok <tool_call>{"name": "calculator_add", "arguments": {"b": 182, "a": 74}}</tool_call>')
    assert call is not None and call.arguments == '{"a": 74, "b": 182}'
    for bad in ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "<tool_call>{oops}</tool_call>",
                "no call", '<tool_call>{"name": "calculator_add", "arguments": [1]}</tool_call>'):
        assert env.parse(bad) is None
    tools = task.make_tools(None)
    first, again = tools.run([call]), task.make_tools(None).run([call])
    assert first == again and first[0].text == "256"
    boom = env.parse('<tool_call>{"name": "calculator_boom", "arguments": {"x": "luck"}}</tool_call>')
    assert boom is not None and tools.run([boom])[0].text == "Error: RuntimeError: no luck"
    obs = env.observe(call, first[0])
    assert "".join(t for t, _ in obs.segments) == "\n<tool_response>\n256\n</tool_response>\n"


def test_tool_episode_played_by_the_driver_is_scored_from_replayed_tools():
    task = _calc()
    p = task.get("train:2")
    call = '<tool_call>{"name": "calculator_add", "arguments": {"a": 74, "b": 182}}</tool_call>'
    scripts = [[f"Let me add. {call}", "It is 256."],  # uses the tool, answers right
               ["It is 256."],  # right answer without the tool: this rubric wants the tool's result
               [f"{call}", "It is 255."]]  # wrong answer
    limits = EpisodeLimits(max_turns=3, max_turn_tokens=200, max_obs_tokens=64, max_total_tokens=600)
    eps = play([task.make_env(p, 0) for _ in scripts], task.make_tools(None), scripts, limits, n=3)
    texts = [text_of(ep) for ep in eps]
    assert texts[0] == f"Let me add. {call}\nIt is 256."
    assert score_group(task, p, texts) == [1.0, 0.0, 0.0]


def test_importing_stoa_tasks_does_not_import_verifiers():
    code = ("import sys, stoa.tasks, stoa.tasks.vf; from stoa.tasks.registry import task_class; task_class('vf'); "
            "assert 'verifiers.v1' not in sys.modules, 'verifiers imported eagerly'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_trainer_replays_the_tool_calls_and_rejects_a_forged_result():
    from stoa.envs.base import ToolResult, result_hash
    from stoa.episodes.replay import replay_group
    from stoa.rollouts.records import RecordRejected
    from tests.envs.fakes import CharCodec, honest_sample

    class ForgedTools:
        """A worker whose calculator answers what it likes."""

        def run(self, calls):
            return [ToolResult("999", result_hash([c.name, c.arguments, "999"])) for c in calls]

    task, codec = _calc(), CharCodec()
    p = task.get("train:2")
    turns = ['<tool_call>{"name": "calculator_add", "arguments": {"a": 74, "b": 182}}</tool_call>', "256$"]  # $: EOS
    limits = EpisodeLimits(max_turns=3, max_turn_tokens=200, max_obs_tokens=64, max_total_tokens=600)
    honest = honest_sample(turns, codec, task.make_tools(None), env=task.make_env(p, 0))
    out = replay_group([task.make_env(p, 0)], [honest], task.make_tools(None), codec, limits, [ord("$")])
    assert out[0].calls == 1 and score_group(task, p, [out[0].text]) == [1.0]
    forged = honest_sample(turns, codec, ForgedTools(), env=task.make_env(p, 0))
    with pytest.raises(RecordRejected, match="observation"):
        replay_group([task.make_env(p, 0)], [forged], task.make_tools(None), codec, limits, [ord("$")])


def test_nondeterministic_tools_need_a_run_that_sets_replay_false():
    from stoa.config.base import ConfigError
    from stoa.trainer.setup import check_replay

    task = _load("vf:vft_calc,tools=nondeterministic,heldout=0,max_turns=3")
    assert is_multiturn(task) and task.deterministic_tools is False
    assert task.spec()["tools"] == "nondeterministic"
    with pytest.raises(ConfigError, match="replay.*not deterministic.*set replay = false"):
        check_replay(True, task)
    assert "rollout/unreplayed" in check_replay(False, task)
