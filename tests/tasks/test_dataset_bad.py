"""The dataset task's bad input (issue 26): each is one line naming the fix, with its own error class (exit code);
and reward functions' outputs fuzzed through ``score_group``: each failure a ``RewardError`` with its reason."""

from __future__ import annotations

import math
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from stoa.tasks import RewardError, RewardFunctionError, TaskOptionError, TaskPluginError, get_task, load_task
from stoa.tasks.scoring import score_group
from tests.tasks.dataset_helpers import ADDITIONS, reward_module, write_jsonl


@pytest.fixture
def additions(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "additions.jsonl", ADDITIONS)


def _one_line(e: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(e.value)
    assert "\n" not in text and "Traceback" not in text
    return text


@pytest.mark.parametrize(("options", "match"), [
    ({"prompt": "question"}, r"no column 'question' in .*additions.jsonl; its columns: \['prompt', 'answer', "
                             r"'level'\]; name the prompt column with prompt=COL"),
    ({"answer": "solution"}, r"no column 'solution' \(option 'answer'\).*its columns: \['prompt', 'answer', 'level'\]"),
    ({"answer": ""}, r"no reward function and no answer column.*give reward=module:fn"),
    ({"reward": ("not a spec",)}, r"'not a spec' is not module:function"),
    ({"reward": ("m:f*heavy",)}, r"is not module:function or module:function\*weight"),
    ({"test_fraction": 1.0}, r"'test_fraction' must be in \[0, 1\)"),
    ({"test_path": "/nonexistent/test.jsonl"}, r"option 'test_path': no such file"),
])
def test_bad_options_are_one_line_task_option_errors(additions, options, match):
    with pytest.raises(TaskOptionError, match=match) as e:
        get_task("dataset", path=str(additions), **options)
    _one_line(e)


@pytest.mark.parametrize(("content", "name", "match"), [
    (b'{"prompt": "a", "answer": "1"}\n{"prompt": \n', "bad.jsonl", r"bad.jsonl:2: not valid JSON"),
    (b'["prompt", "answer"]\n', "list.jsonl", r"list.jsonl:1: expected a JSON object"),
    (b'{"prompt": 7, "answer": "1"}\n', "num.jsonl", r"column 'prompt' must be a string or a list of chat messages"),
    (b'{"prompt": [{"role": "robot", "content": "x"}], "answer": "1"}\n', "robot.jsonl", "chat messages"),
    (b'{"prompt": "a", "answer": "1"}\n{"answer": "2"}\n', "gap.jsonl", r"row 1 has no column 'prompt'"),
    (b'{"prompt": "a", "answer": "1"}\n', "data.csv", r"is not a .jsonl or .parquet file"),
    (b"PAR1 not really", "broken.parquet", r"not a readable parquet file"),
])
def test_bad_files_are_one_line_task_option_errors(tmp_path, content, name, match):
    if name.endswith(".parquet"):
        pytest.importorskip("pyarrow", reason="parquet needs pyarrow (stoa[data])")
    (tmp_path / name).write_bytes(content)
    with pytest.raises(TaskOptionError, match=match) as e:
        get_task("dataset", path=str(tmp_path / name), test_fraction=0.0)
    _one_line(e)


def test_folders_without_train_data_name_the_fix(tmp_path):
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "dataset_dict.json").write_text("{}")
    with pytest.raises(TaskOptionError, match=r"save_to_disk directory; export each split.*to_parquet"):
        get_task("dataset", path=str(tmp_path / "saved"))
    with pytest.raises(TaskOptionError, match="holds no train.jsonl or train.parquet"):
        get_task("dataset", path=str(tmp_path))
    with pytest.raises(TaskOptionError, match="option 'path': no such file"):
        load_task(f"dataset:{tmp_path / 'missing.jsonl'}")
    with pytest.raises(TaskOptionError, match="give option 'path' .* or option 'hf' .*, exactly one"):
        get_task("dataset")


def test_a_reward_module_that_does_not_import_is_a_plugin_error(tmp_path, monkeypatch, additions):
    broken = reward_module(tmp_path, monkeypatch, "import no_such_package_here\n")
    cases = [("absent_module_xyz:f", "cannot import 'absent_module_xyz'.*put absent_module_xyz.py in the working"),
             (f"{broken}:f", f"cannot import '{broken}'.*no_such_package_here"),
             (f"{reward_module(tmp_path, monkeypatch, '1 / 0')}:f", "failed.*ZeroDivisionError.*fix the module"),
             (f"{reward_module(tmp_path, monkeypatch, 'f = 3')}:f", "has no function 'f'")]
    for spec, match in cases:
        with pytest.raises(TaskPluginError, match=match) as e:
            get_task("dataset", path=str(additions), reward=(spec,))
        assert not isinstance(e.value, RewardFunctionError)
        _one_line(e)


@pytest.mark.parametrize(("source", "match"), [
    ("def f(completions, solution, **kw):\n    return [0.0]", r"parameter 'solution' cannot be filled: it is not a "
                                                           r"column \(columns: \['answer', 'completions', 'level', "),
    ("def f(completions, completion_ids):\n    return [0.0]", "'completion_ids' cannot be filled: stoa scores text"),
    ("def f(completions, /, **kw):\n    return [0.0]", "parameter 'completions' cannot be filled"),
    ("def f(completions, **kw):\n    return [1.0]", r"returned 1 values; return a list with one number per"),
    ("def f(completions, **kw):\n    return 1.0", r"returned float; return a list"),
    ("def f(completions, **kw):\n    return ['good', 'bad']", r"returned str 'good', not a number"),
    ("def f(completions, **kw):\n    return [c[0]['content'] for c in completions]",
     r"a plain-text prompt: completions are strings\) with 2 completions, raised IndexError"),
])
def test_a_reward_function_that_cannot_be_called_is_refused_at_start_up(tmp_path, monkeypatch, additions, source,
                                                                         match):
    mod = reward_module(tmp_path, monkeypatch, source)
    with pytest.raises(RewardFunctionError, match=match) as e:
        load_task(f"dataset:path={additions},reward={mod}:f")
    assert f"reward function {mod}:f" in _one_line(e)


FUZZ = """
import threading

RELEASE = threading.Event()
VALID = object()
OUT = VALID

def f(completions, **kw):
    if OUT is VALID:
        return [0.0] * len(completions)
    if OUT == "raise":
        raise KeyError("boom")
    if OUT == "hang":
        RELEASE.wait(10)
    return OUT
"""

_ITEM = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**6, 10**6), st.none(),
                  st.text(max_size=3), st.booleans())


def _expected(out: Any, n: int, weight: float) -> str | None:
    """The reason ``score_group`` must give for one function's output, or None when it is fine."""
    if not isinstance(out, list) or len(out) != n:
        return "reward_wrong_length"
    if any(v is None or isinstance(v, str) or not math.isfinite(weight * float(v)) for v in out):  # 2 * 1e308
        return "reward_not_finite"
    return None


def test_fuzzed_reward_outputs_are_named_rejections(tmp_path, monkeypatch, additions):
    name = reward_module(tmp_path, monkeypatch, FUZZ)
    task = get_task("dataset", path=str(additions), reward=(f"{name}:f*2",))
    mod: Any = sys.modules[name]
    prompt, seen = task.get("train:0"), set()

    @settings(max_examples=200, deadline=None)
    @given(out=st.one_of(st.lists(_ITEM, min_size=0, max_size=5), _ITEM, st.just({"a": 1.0}),
                         st.lists(st.floats(-1e6, 1e6) | st.integers(-9, 9), min_size=3, max_size=3)))
    @example(out=[0.5, -1, True])
    @example(out=[1e308, 0.0, 0.0])  # finite, but not once weighted
    @example(out=[0.0, "1", 0.0])  # a string float() would take
    def check(out: Any) -> None:
        mod.OUT = out
        want = _expected(out, 3, 2.0)
        seen.add(want)
        if want is None:
            assert score_group(task, prompt, ["a", "b", "c"]) == [2.0 * float(v) for v in out]
            return
        with pytest.raises(RewardError) as e:
            score_group(task, prompt, ["a", "b", "c"])
        assert e.value.reason == want
        first_bad = next((v for v in out if v is None or isinstance(v, str) or not math.isfinite(2.0 * v)), None) \
            if want == "reward_not_finite" else None
        if isinstance(first_bad, str):  # a string is named (scoring's float() would take "1")
            assert f"a reward is str from {name}:f, not a number" in str(e.value)

    check()
    assert seen == {None, "reward_wrong_length", "reward_not_finite"}


def test_raising_and_hanging_reward_functions_are_named_rejections(tmp_path, monkeypatch, additions):
    name = reward_module(tmp_path, monkeypatch, FUZZ)
    task = get_task("dataset", path=str(additions), reward=(f"{name}:f",))
    mod: Any = sys.modules[name]
    prompt = task.get("train:1")
    mod.OUT = "raise"
    with pytest.raises(RewardError, match="reward_raised: dataset: the reward code raised KeyError") as e:
        score_group(task, prompt, ["x"])
    assert e.value.reason == "reward_raised"
    assert task.is_correct(prompt, "x") is False  # an evaluation scores it wrong and goes on
    mod.OUT = "hang"
    try:
        with pytest.raises(RewardError) as e:
            score_group(task, prompt, ["x", "y"], timeout_s=0.05)
        assert e.value.reason == "reward_timeout"
    finally:
        mod.RELEASE.set()
    for t in [t for t in threading.enumerate() if t.name == "reward-dataset"]:
        t.join(5)  # the abandoned call ends once the function returns
        assert not t.is_alive()


def test_none_from_one_function_counts_as_nothing_when_another_scores(tmp_path, monkeypatch, additions):
    name = reward_module(tmp_path, monkeypatch, """
        def maybe(completions, **kw):
            return [None if c == "skip" else 1.0 for c in completions]

        def always(completions, **kw):
            return [0.5] * len(completions)
    """)
    both = get_task("dataset", path=str(additions), reward=(f"{name}:maybe", f"{name}:always"))
    assert score_group(both, both.get("train:0"), ["skip", "go"]) == [0.5, 1.5]
    alone = get_task("dataset", path=str(additions), reward=(f"{name}:maybe",))
    with pytest.raises(RewardError) as e:
        score_group(alone, alone.get("train:0"), ["skip", "go"])
    assert e.value.reason == "reward_not_finite"


def test_a_test_file_without_the_answer_column_is_refused(tmp_path):
    write_jsonl(tmp_path / "d" / "train.jsonl", ADDITIONS[:10])
    write_jsonl(tmp_path / "d" / "test.jsonl", [{"prompt": r["prompt"]} for r in ADDITIONS[10:]])
    with pytest.raises(TaskOptionError, match=r"no column 'answer' in .*test.jsonl; its columns: \['prompt'\]; give "
                                              "every split the answer column"):
        get_task("dataset", path=str(tmp_path / "d"))
