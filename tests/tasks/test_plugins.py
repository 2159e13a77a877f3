"""Task plugins: ``module.path:ClassName`` and ``stoa.tasks`` entry points, their recorded code identity, and
reward code that fails without stopping anything (``stoa.tasks.registry``, ``.code``, ``.scoring``)."""

from __future__ import annotations

import json
import math
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stoa.cli import main
from stoa.contract import ModelSpec, RunContract, SamplingSpec
from stoa.tasks import (
    RewardError,
    TaskPluginError,
    get_task,
    known_tasks,
    load_task,
    parse_task_spec,
    task_name,
)
from stoa.tasks.code import TaskCodeMismatch, check_task_code, from_contract, identify, task_code
from stoa.tasks.scoring import judge, rewards_or_zeros, score_group
from stoa.untrusted import BadBucketObject

QUIZ = '''
import numpy as np
from stoa.tasks.base import Prompt, chat_messages, format_prompt_id, parse_prompt_id

class Quiz:
    """Three questions; the answer is the question's number doubled."""
    OPTIONS = {"n": int, "tag": tuple}
    reward_version = "1"

    def __init__(self, n: int = 3, tag: tuple = ()):
        self.id, self.n, self.tag = "quiz", n, tag

    def spec(self):
        return {"n": self.n, "tag": list(self.tag)}

    def get(self, prompt_id):
        split, i = parse_prompt_id(self.id, prompt_id, ("train", "test"))
        return Prompt(format_prompt_id(split, i), chat_messages(f"double {i}"), str(2 * i))

    def sample_train(self, rng):
        return self.get(format_prompt_id("train", int(rng.integers(self.n))))

    def heldout(self, n):
        return [self.get(format_prompt_id("test", i)) for i in range(n)]

    def reward(self, prompt, completion):
        return float(completion.strip() == prompt.answer)

    def is_correct(self, prompt, completion):
        return self.reward(prompt, completion) == 1.0

class NotATask:
    OPTIONS = {}
    def get(self, prompt_id):
        return None
'''


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding ``quiz_plugin.py`` (a loose module, as a user writes one)."""
    (tmp_path / "quiz_plugin.py").write_text(QUIZ)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("quiz_plugin", None)


def test_a_module_class_spec_builds_the_plugin_with_typed_and_repeatable_options(plugin_dir: Path) -> None:
    name, opts = parse_task_spec("quiz_plugin:Quiz:n=5,tag=a,tag=b")
    assert (name, opts) == ("quiz_plugin:Quiz", {"n": 5, "tag": ("a", "b")})
    task = load_task("quiz_plugin:Quiz:n=5,tag=a,tag=b")
    assert task_name(task) == "quiz_plugin:Quiz" and task.id == "quiz"
    again = get_task(task_name(task), **task.spec())  # how a worker rebuilds it from the contract
    assert again.spec() == task.spec() and again.get("test:2").answer == "4"
    with pytest.raises(ValueError, match="option 'n' must be an integer"):
        parse_task_spec("quiz_plugin:Quiz:n=two")
    with pytest.raises(ValueError, match="option 'n' given twice"):
        parse_task_spec("quiz_plugin:Quiz:n=1,n=2")


@pytest.mark.parametrize(("spec", "message"), [
    ("no_such_module_xyz:Task", "cannot import 'no_such_module_xyz'.*put no_such_module_xyz.py in the working"),
    ("quiz_plugin:Missing", "has no class 'Missing'"),
    ("quiz_plugin:NotATask", "is not a task: it lacks sample_train, heldout, reward, is_correct, spec"),
    ("json:JSONDecoder", "is not a task"),
])
def test_a_plugin_that_cannot_be_used_is_one_line_naming_the_fix(plugin_dir: Path, spec: str, message: str) -> None:
    with pytest.raises(TaskPluginError, match=message):
        load_task(spec)


def test_a_plugin_whose_import_raises_is_a_plugin_error(plugin_dir: Path) -> None:
    (plugin_dir / "broken_plugin.py").write_text("raise RuntimeError('no GPU here')\n")
    with pytest.raises(TaskPluginError, match="importing 'broken_plugin' failed .*no GPU here"):
        load_task("broken_plugin:Task")


def test_the_cli_exits_14_with_one_line_for_a_plugin_that_does_not_import(plugin_dir: Path, capsys) -> None:
    code = main(["trainer", "--task", "no_such_module_xyz:Task", "--model", "tiny", "--bucket",
                 str(plugin_dir / "b"), "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 14 and len(err) == 1 and err[0].startswith("stoa: task plugin: ")
    assert not (plugin_dir / "b").exists()  # nothing written


def test_unknown_names_list_adapters_and_the_module_form() -> None:
    assert {"arithmetic", "dataset", "rg", "vf"} <= set(known_tasks())
    with pytest.raises(ValueError, match=r"unknown task 'nope'.*module.path:ClassName"):
        parse_task_spec("nope:x=1")


def _write_dist(site: Path, module_src: str, version: str) -> None:
    """An installed distribution ``my-quiz`` (dist-info with an entry point) providing ``my_quiz``."""
    (site / "my_quiz").mkdir(parents=True, exist_ok=True)
    (site / "my_quiz" / "__init__.py").write_text(module_src)
    info = site / f"my_quiz-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: my-quiz\nVersion: {version}\n")
    (info / "top_level.txt").write_text("my_quiz\n")
    (info / "entry_points.txt").write_text("[stoa.tasks]\nmy-quiz = my_quiz:Quiz\n")


def test_an_entry_point_names_a_task_and_its_code_is_recorded_and_checked(tmp_path: Path, monkeypatch) -> None:
    site = tmp_path / "site"
    _write_dist(site, QUIZ, "1.0")
    monkeypatch.syspath_prepend(str(site))
    try:
        task = load_task("my-quiz:n=4")
        assert task_name(task) == "my-quiz" and "my-quiz" in known_tasks()
        (code,) = task_code(task)
        assert (code.module, code.dist, code.version) == ("my_quiz", "my-quiz", "1.0") and len(code.sha256) == 64
        check_task_code((code,))  # the same code here: no complaint
        (site / "my_quiz" / "__init__.py").write_text(QUIZ.replace("2 * i", "3 * i"))  # another build
        with pytest.raises(TaskCodeMismatch, match=r"differs here .*pip install 'my-quiz==1.0'"):
            check_task_code((code,))
        (site / "my_quiz" / "__init__.py").unlink()
        (site / "my_quiz").rmdir()
        with pytest.raises(TaskCodeMismatch, match=r"not installed here; pip install 'my-quiz==1.0'"):
            check_task_code((code,))
    finally:
        sys.modules.pop("my_quiz", None)


def test_a_loose_module_is_recorded_and_a_changed_copy_is_refused(plugin_dir: Path) -> None:
    task = load_task("quiz_plugin:Quiz")
    (code,) = task_code(task)
    assert (code.module, code.dist) == ("quiz_plugin", "")
    assert identify("quiz_plugin") == code
    (plugin_dir / "quiz_plugin.py").write_text(QUIZ + "\n# edited\n")
    with pytest.raises(TaskCodeMismatch, match="copy the trainer's quiz_plugin.py"):
        check_task_code((code,))


@pytest.mark.parametrize("module", ["json", "os", "stoa", "antigravity"])
def test_a_contract_naming_the_standard_library_or_stoa_as_task_code_is_refused(module: str) -> None:
    forged = from_contract(({"module": module, "dist": "", "version": "", "sha256": "0" * 64},))
    with pytest.raises(TaskCodeMismatch, match="not a task plugin; the contract is forged"):
        check_task_code(forged)


def _contract(task_code_field: object = None) -> RunContract:
    c = RunContract(run_id="r", model=ModelSpec("a", "c", "t", 100), n_samples=2, plane="bf16", task_id="quiz",
                    task_spec={}, reward_version="1", sampling=SamplingSpec())
    return c if task_code_field is None else RunContract(**{**c.__dict__, "task_code": task_code_field})


def test_the_contract_carries_task_code_and_a_builtin_run_json_is_unchanged() -> None:
    plain = _contract()
    assert b"task_code" not in plain.to_json()
    entry = {"module": "my_quiz", "dist": "my-quiz", "version": "1.0", "sha256": "a" * 64}
    with_code = _contract((entry,))
    back = RunContract.from_json(with_code.to_json())
    assert back.task_code == (entry,) and back.fingerprint() == with_code.fingerprint() != plain.fingerprint()
    assert with_code.mismatches(plain) == ["task_code"]


@pytest.mark.parametrize("bad", [
    "x", [{"module": "m"}], [{"module": "m", "dist": "", "version": "", "sha256": 5}],
    [{"module": "m", "dist": "", "version": "", "sha256": "", "extra": ""}], [{}] * 17,
])
def test_a_forged_task_code_field_is_a_bad_bucket_object(bad: object) -> None:
    d = json.loads(_contract().to_json())
    d["task_code"] = bad
    with pytest.raises(BadBucketObject, match="not a run contract"):
        RunContract.from_json(json.dumps(d).encode())


class _Fixed:
    """A task whose batch reward returns whatever the test sets (a user's reward code, misbehaving)."""

    id = "fixed"
    reward_version = "1"

    def __init__(self, out: object) -> None:
        self.out = out

    def rewards(self, prompt, completions):
        if isinstance(self.out, BaseException):
            raise self.out
        if self.out == "hang":
            time.sleep(5)
        return self.out

    def is_correct(self, prompt, completion):
        if isinstance(self.out, BaseException):
            raise self.out
        return True


def _prompt():
    from stoa.tasks import Prompt
    return Prompt("train:0", ({"role": "user", "content": "q"},), "a")


@pytest.mark.parametrize(("out", "reason"), [
    (ValueError("bad row"), "reward_raised"), (SystemExit(3), "reward_raised"), ([math.nan, 1.0], "reward_not_finite"),
    ([math.inf, 0.0], "reward_not_finite"), (["1", "x"], "reward_not_finite"), ([None, 1.0], "reward_not_finite"),
    ([1.0], "reward_wrong_length"), ("11", "reward_wrong_length"), (1.0, "reward_wrong_length"),
    ("hang", "reward_timeout"),
])
def test_reward_code_that_fails_is_a_named_reward_error(out: object, reason: str) -> None:
    with pytest.raises(RewardError) as info:
        score_group(_Fixed(out), _prompt(), ["a", "b"], timeout_s=0.3)  # type: ignore[arg-type]
    assert info.value.reason == reason
    assert rewards_or_zeros(_Fixed(out) if out != "hang" else _Fixed([0.0]), _prompt(), ["a", "b"]) == [0.0, 0.0]


def test_numbers_of_any_numeric_type_are_floats() -> None:
    import numpy as np
    assert score_group(_Fixed([np.float32(0.5), 1]), _prompt(), ["a", "b"]) == [0.5, 1.0]  # type: ignore[arg-type]
    assert judge(_Fixed([1.0]), _prompt(), "a") is True  # type: ignore[arg-type]
    with pytest.raises(RewardError, match="reward_raised"):
        judge(_Fixed(KeyError("k")), _prompt(), "a")  # type: ignore[arg-type]


def test_a_plugin_file_in_the_working_directory_is_found_without_sys_path(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "cwd_quiz.py").write_text(textwrap.dedent(QUIZ))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        assert load_task("cwd_quiz:Quiz").id == "quiz"
    finally:
        sys.modules.pop("cwd_quiz", None)


def test_stoa_task_prints_the_contract_form_the_code_and_scores_the_reference_answers(plugin_dir: Path,
                                                                                      capsys) -> None:
    assert main(["task", "quiz_plugin:Quiz:n=3", "--n", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("task quiz_plugin:Quiz (quiz_plugin.Quiz), reward version 1\n")
    assert "code every worker needs: quiz_plugin (copy the trainer's quiz_plugin.py" in out
    assert out.count("reward 1; an empty completion: 0") == 2


def test_stoa_task_with_reward_code_that_raises_is_one_line_and_exit_15(plugin_dir: Path, capsys) -> None:
    (plugin_dir / "raising_plugin.py").write_text(QUIZ.replace(
        "return float(completion.strip() == prompt.answer)", "raise KeyError('column')"))
    try:
        assert main(["task", "raising_plugin:Quiz"]) == 15
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "reward_raised: quiz: the reward code raised KeyError" in err
    finally:
        sys.modules.pop("raising_plugin", None)
