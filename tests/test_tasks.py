"""Tests for the task layer: ids, determinism, split disjointness, exact rewards, extraction, specs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from stoa.tasks import (
    ArithmeticTask,
    GSM8KTask,
    Prompt,
    PromptIdError,
    Task,
    extract_answer,
    get_task,
    load_task,
    normalize_number,
    parse_task_spec,
)
from stoa.tasks.gsm8k import parse_gsm8k_answer

REPO = Path(__file__).resolve().parents[1]


def _gsm8k_dir() -> Path | None:
    for base in (REPO / "shared", REPO.parent / "shared"):
        d = base / "data" / "gsm8k"
        if (d / "train.jsonl").is_file() and (d / "test.jsonl").is_file():
            return d
    return None


GSM8K_DIR = _gsm8k_dir()
needs_gsm8k = pytest.mark.skipif(GSM8K_DIR is None, reason="shared/data/gsm8k not present")


@pytest.fixture(scope="module")
def gsm8k() -> GSM8KTask:
    assert GSM8K_DIR is not None
    return GSM8KTask(path=str(GSM8K_DIR / "train.jsonl"))


def _write_jsonl(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------- extraction

EXTRACTION_CASES = [
    ("#### 42", "42"),
    ("####42", "42"),
    ("Step 1: 3 + 4 = 7\nStep 2: 7 * 6 = 42\n#### 42", "42"),
    ("\\boxed{42}", "42"),
    ("So the total is $\\boxed{1,234}$ dollars.", "1234"),
    ("The answer is \\boxed{\\$18}.", "18"),
    ("The answer is 42.", "42"),
    ("The final answer is: $1,234.50", "1234.5"),
    ("Answer: -7", "-7"),
    ("**42**", "42"),
    ("She earns $1,234 in total", "1234"),
    ("42.0", "42"),
    ("0.50", "0.5"),
    ("x = -3", "-3"),
    ("The difference is 5-3 = 2", "2"),
    ("10 - 3 = 7", "7"),
    ("so 6 * 7 = 42", "42"),
    ("It takes 3 hours.", "3"),
    ("The answer is 12. Check: 6 * 2 = 12, and 12 + 0 = 12", "12"),
    ("The answer is 8. Unrelated: 100 apples", "8"),
    ("#### 18\n\nQuestion: Tom has 5 apples", "18"),
    ("\\boxed{5}\n#### 6", "6"),
    ("\\boxed{5 + 3 = 8}", "8"),
    ("the answer isn't 5, it is 6", "6"),
    ("<think>the answer is 5</think>The result is 6", "6"),
    ("<answer>72</answer>", "72"),
    ("The values are 1, 2, 3", "3"),
    ("In total (-15) degrees", "-15"),
    ("\u22127", "-7"),
    ("#### 1,000,000", "1000000"),
    ("version 3.5.2", "3.5"),
    ("about 50% of them", "50"),
    ("I don't know.", None),
    ("", None),
    ("#### \\boxed{}", None),
]


@pytest.mark.parametrize(("completion", "expected"), EXTRACTION_CASES)
def test_extraction_table(completion: str, expected: str | None) -> None:
    assert extract_answer(completion) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1,234", "1234"),
        ("$1,234.00", "1234"),
        ("42.", "42"),
        ("-0", "0"),
        ("-0.0", "0"),
        ("007", "7"),
        (" 18 ", "18"),
        ("12345678901234567890123456789012.5", "12345678901234567890123456789012.5"),
        ("1 2", None),
        ("abc", None),
        ("", None),
    ],
)
def test_normalize_number(text: str, expected: str | None) -> None:
    assert normalize_number(text) == expected


@given(
    st.integers(min_value=-(10**12), max_value=10**12), st.sampled_from(["plain", "comma", "dollar", "dot0"])
)
def test_extraction_roundtrip(n: int, style: str) -> None:
    if style == "plain":
        s = str(n)
    elif style == "comma":
        s = f"{n:,}"
    elif style == "dollar":
        s = ("-" if n < 0 else "") + f"${abs(n):,}"
    else:
        s = f"{n}.0"
    for completion in (f"#### {s}", f"\\boxed{{{s}}}", f"The answer is {s}.", f"So we get {s}"):
        assert extract_answer(completion) == str(n), completion


@pytest.mark.parametrize(
    "completion",
    [
        "\\boxed{" * 4000,
        "<answer>" * 4000,
        "####" * 8000,
        "The answer is " * 2500,
        "Answer: " * 4000 + "7",
        "{" * 32000 + "\\boxed{5",
        "1," * 16000,
        "-" * 32000,
    ],
)
def test_extraction_is_fast_on_adversarial_input(completion: str) -> None:
    # The trainer runs extraction on untrusted completions; it must not go quadratic (linear: ~0.05 s here;
    # quadratic on these 32k-character inputs: many seconds). Best of three, so one pause of a busy machine
    # does not fail it.
    def once() -> float:
        start = time.perf_counter()
        extract_answer(completion)
        return time.perf_counter() - start

    assert min(once() for _ in range(3)) < 0.5


def test_no_torch_or_mlx_import() -> None:
    code = "import sys, stoa.tasks; bad = [m for m in ('torch', 'mlx', 'datasets') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------- arithmetic


def test_arithmetic_is_a_task() -> None:
    assert isinstance(ArithmeticTask(), Task)
    assert isinstance(get_task("arithmetic"), Task)


def test_arithmetic_prompt_shape() -> None:
    p = ArithmeticTask().get("train:0")
    assert len(p.messages) == 1 and p.messages[0]["role"] == "user"
    content = p.messages[0]["content"]
    assert content.startswith("What is ") and content.endswith("? Answer with just the number.")
    a, b = content.removeprefix("What is ").split("?")[0].split(" + ")
    assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99
    assert p.answer == str(int(a) + int(b))
    sys_p = ArithmeticTask(system="Be terse.").get("train:0")
    assert sys_p.messages[0] == {"role": "system", "content": "Be terse."}
    assert sys_p.messages[1] == p.messages[0]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"digits": 3},
        {"ops": "+-*", "n_terms": 3},
        {"digits": 1, "ops": "*"},
        {"digits": 4, "ops": "-*", "seed": 7},
    ],
)
def test_arithmetic_deterministic_across_instances(options: dict[str, object]) -> None:
    a, b = get_task("arithmetic", **options), get_task("arithmetic", **options)
    for pid in ["train:0", "train:1", "train:4611686018427387903", "test:0", "test:17"]:
        assert a.get(pid) == b.get(pid)
        assert a.get(pid).id == pid
    rng1, rng2 = np.random.default_rng(5), np.random.default_rng(5)
    assert [a.sample_train(rng1) for _ in range(20)] == [b.sample_train(rng2) for _ in range(20)]
    assert a.heldout(10) == b.heldout(10)


def test_arithmetic_answers_are_evaluated_with_precedence() -> None:
    task = ArithmeticTask(ops="+-*", n_terms=4, digits=2)
    for i in range(200):
        p = task.get(f"train:{i}")
        expr = p.messages[-1]["content"].removeprefix("What is ").split("?")[0]
        assert set(expr) <= set("0123456789+-* ")
        assert p.answer == str(eval(expr))  # the rendered expression is plain Python syntax


def test_arithmetic_seed_changes_problems() -> None:
    a, b = ArithmeticTask(seed=0), ArithmeticTask(seed=1)
    assert [a.get(f"train:{i}") for i in range(10)] != [b.get(f"train:{i}") for i in range(10)]


def _problem_text(p: Prompt) -> str:
    return p.messages[-1]["content"]


@pytest.mark.parametrize(
    "options",
    [{}, {"digits": 1}, {"digits": 3}, {"ops": "+-*"}, {"digits": 2, "ops": "*", "n_terms": 3}],
)
def test_arithmetic_splits_disjoint_by_problem(options: dict[str, object]) -> None:
    task = get_task("arithmetic", **options)
    test_texts = {_problem_text(p) for p in task.heldout(300)}
    rng = np.random.default_rng(0)
    train_texts = {_problem_text(task.sample_train(rng)) for _ in range(3000)}
    train_texts |= {_problem_text(task.get(f"train:{i}")) for i in range(300)}
    assert test_texts and train_texts
    assert not test_texts & train_texts


def test_arithmetic_heldout_is_independent_of_seed() -> None:
    # Membership is a property of the problem text, so training with any seed never sees a
    # problem that another seed holds out.
    rng = np.random.default_rng(1)
    held = {_problem_text(p) for p in ArithmeticTask(seed=0).heldout(400)}
    other = ArithmeticTask(seed=99)
    assert not held & {_problem_text(other.sample_train(rng)) for _ in range(3000)}


def test_arithmetic_small_space_heldout_is_distinct() -> None:
    task = ArithmeticTask()  # 2-digit addition: 8100 problems, about 810 held out
    texts = [_problem_text(p) for p in task.heldout(500)]
    assert len(set(texts)) == 500
    assert task.heldout(5) == task.heldout(500)[:5]


def test_arithmetic_reward_exact() -> None:
    task = ArithmeticTask()
    p = task.get("test:3")
    right, wrong = p.answer, str(int(p.answer) + 1)
    for completion in (
        right,
        f"{right}.",
        f" {right}\n",
        f"The answer is {right}.",
        f"#### {right}",
        f"\\boxed{{{right}}}",
    ):
        assert task.reward(p, completion) == 1.0, completion
        assert task.is_correct(p, completion)
    for completion in (
        wrong,
        f"The answer is {wrong}.",
        "",
        "I cannot say",
        "🙂" * 50,
        f"{right}0",
        f"-{right}",
    ):
        assert task.reward(p, completion) == 0.0, completion
        assert not task.is_correct(p, completion)


def test_arithmetic_format_reward() -> None:
    task = ArithmeticTask(format_reward=0.1)
    p = task.get("train:9")
    wrong = str(int(p.answer) + 1)
    assert task.reward(p, p.answer) == 1.0
    assert task.reward(p, wrong) == 0.1  # just a number, but the wrong one
    assert task.reward(p, f"I think it is {wrong}") == 0.0
    assert task.reward(p, "no idea") == 0.0
    assert ArithmeticTask().reward(p, wrong) == 0.0


@pytest.mark.parametrize(
    "bad_id",
    [
        "",
        "train",
        "train:",
        ":1",
        "train:-1",
        "train:01",
        "train:1.5",
        "train:abc",
        "dev:0",
        "Train:0",
        " train:0",
        "train:0 ",
        "train:1:2",
    ],
)
def test_arithmetic_malformed_ids(bad_id: str) -> None:
    task = ArithmeticTask()
    with pytest.raises(PromptIdError) as e:
        task.get(bad_id)
    assert repr(bad_id) in str(e.value) or "unknown split" in str(e.value)
    assert isinstance(e.value, ValueError) and isinstance(e.value, KeyError)


def test_prompt_id_error_message_is_readable() -> None:
    with pytest.raises(KeyError) as e:
        ArithmeticTask().get("oops")
    msg = str(e.value)
    assert msg.startswith("arithmetic: malformed prompt id 'oops'")
    assert "'train:0'" in msg


@pytest.mark.parametrize(
    ("options", "names"),
    [
        ({"digits": 0}, "digits"),
        ({"digits": 19}, "digits"),
        ({"digits": "two"}, "digits"),
        ({"digits": 2.5}, "digits"),
        ({"digits": True}, "digits"),
        ({"ops": ""}, "ops"),
        ({"ops": "+/"}, "ops"),
        ({"n_terms": 1}, "n_terms"),
        ({"seed": -1}, "seed"),
        ({"format_reward": 1.0}, "format_reward"),
        ({"format_reward": -0.1}, "format_reward"),
        ({"format_reward": "lots"}, "format_reward"),
        ({"system": 3}, "system"),
        ({"difficulty": 3}, "difficulty"),
    ],
)
def test_arithmetic_option_validation(options: dict[str, object], names: str) -> None:
    with pytest.raises(ValueError, match=f"'{names}'"):
        get_task("arithmetic", **options)


@pytest.mark.parametrize(
    "options", [{}, {"digits": 3, "ops": "-*", "n_terms": 3, "seed": 5, "format_reward": 0.1}]
)
def test_arithmetic_spec_round_trip(options: dict[str, object]) -> None:
    task = get_task("arithmetic", **options)
    again = get_task("arithmetic", **task.spec())
    assert again.spec() == task.spec()
    assert [again.get(f"train:{i}") for i in range(5)] == [task.get(f"train:{i}") for i in range(5)]
    with pytest.raises(ValueError, match="option 'prompt_version'"):
        get_task("arithmetic", **{**task.spec(), "prompt_version": 999})


def test_arithmetic_spec_is_json_and_canonical() -> None:
    spec = get_task("arithmetic", ops="*+-+", digits="3").spec()
    assert json.loads(json.dumps(spec)) == spec
    assert spec["ops"] == "+-*" and spec["digits"] == 3
    assert get_task("arithmetic", ops="-+").get("train:5") == get_task("arithmetic", ops="+-").get("train:5")
    assert ArithmeticTask().reward_version == get_task("arithmetic").reward_version


def test_heldout_negative_n() -> None:
    with pytest.raises(ValueError):
        ArithmeticTask().heldout(-1)
    assert ArithmeticTask().heldout(0) == []


# ---------------------------------------------------------------- task registry and specs


def test_get_task_unknown_lists_known() -> None:
    known = r"\['arithmetic', 'dataset', 'gsm8k', 'rg', 'search', 'searchqa', 'toy', 'vf', 'walk'\]"
    with pytest.raises(ValueError, match=rf"unknown task 'math'.*{known}"):
        get_task("math")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("arithmetic", ("arithmetic", {})),
        ("arithmetic:", ("arithmetic", {})),
        ("arithmetic:digits=2,ops=+-", ("arithmetic", {"digits": 2, "ops": "+-"})),
        (
            " arithmetic : digits = 3 , n_terms=4,seed=9,format_reward=0.05",
            ("arithmetic", {"digits": 3, "n_terms": 4, "seed": 9, "format_reward": 0.05}),
        ),
        ("arithmetic:ops=*", ("arithmetic", {"ops": "*"})),
        ("gsm8k:path=/x/train.jsonl", ("gsm8k", {"path": "/x/train.jsonl"})),
        (
            "gsm8k:path=C:/data/train.jsonl,answer_format=boxed",
            ("gsm8k", {"path": "C:/data/train.jsonl", "answer_format": "boxed"}),
        ),
        ("gsm8k:hf=openai/gsm8k,hf_config=main", ("gsm8k", {"hf": "openai/gsm8k", "hf_config": "main"})),
    ],
)
def test_parse_task_spec(spec: str, expected: tuple[str, dict[str, object]]) -> None:
    assert parse_task_spec(spec) == expected


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("nope:digits=2", "unknown task 'nope'"),
        ("arithmetic:digits", "expected key=value"),
        ("arithmetic:=2", "expected key=value"),
        ("arithmetic:digits=2,digits=3", "'digits' given twice"),
        ("arithmetic:digits=two", "'digits' must be an integer"),
        ("arithmetic:size=2", "unknown option 'size'"),
        ("gsm8k:pth=/x", "unknown option 'pth'"),
    ],
)
def test_parse_task_spec_errors(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_task_spec(spec)


def test_load_task_round_trip() -> None:
    task = load_task("arithmetic:digits=3,ops=+-,seed=4")
    assert isinstance(task, ArithmeticTask)
    assert task.get("test:1") == ArithmeticTask(digits=3, ops="+-", seed=4).get("test:1")


# ---------------------------------------------------------------- gsm8k


@needs_gsm8k
def test_gsm8k_counts_and_spec(gsm8k: GSM8KTask) -> None:
    assert GSM8K_DIR is not None
    assert len(gsm8k.train) == 7473 and len(gsm8k.test) == 1319
    spec = gsm8k.spec()
    assert json.loads(json.dumps(spec)) == spec
    assert spec["n_train"] == 7473 and spec["n_test"] == 1319
    assert isinstance(spec["train_sha256"], str) and len(spec["train_sha256"]) == 64
    assert spec["path"] == str((GSM8K_DIR / "train.jsonl").resolve())
    assert spec["test_path"] == str((GSM8K_DIR / "test.jsonl").resolve())


@needs_gsm8k
def test_gsm8k_spec_round_trip(gsm8k: GSM8KTask) -> None:
    # A worker rebuilds the task from the run contract's task spec.
    again = get_task("gsm8k", **gsm8k.spec())
    assert again.spec() == gsm8k.spec()
    assert again.get("test:7") == gsm8k.get("test:7")


def test_gsm8k_spec_checks_fail_closed(tmp_path: Path) -> None:
    rows = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(4)]
    _write_jsonl(tmp_path / "train.jsonl", rows)
    _write_jsonl(tmp_path / "test.jsonl", rows[:1])
    spec = GSM8KTask(path=str(tmp_path)).spec()
    _write_jsonl(tmp_path / "train.jsonl", rows[::-1])  # same problems, another order: other ids
    with pytest.raises(ValueError, match="option 'train_sha256'"):
        get_task("gsm8k", **spec)
    _write_jsonl(tmp_path / "train.jsonl", rows[:3])
    with pytest.raises(ValueError, match="option 'n_train'"):
        get_task("gsm8k", **spec)
    with pytest.raises(ValueError, match="option 'prompt_version'"):
        get_task("gsm8k", path=str(tmp_path), prompt_version=99)
    (tmp_path / "test.jsonl").unlink()
    no_test = GSM8KTask(path=str(tmp_path))
    assert no_test.spec()["test_sha256"] == "" and "test_path" not in no_test.spec()
    assert get_task("gsm8k", **no_test.spec()).spec() == no_test.spec()


@needs_gsm8k
@pytest.mark.parametrize("name", ["train.jsonl", "test.jsonl"])
def test_gsm8k_every_answer_parses(name: str) -> None:
    assert GSM8K_DIR is not None
    lines = (GSM8K_DIR / name).read_text(encoding="utf-8").splitlines()
    parsed = [parse_gsm8k_answer(json.loads(line)["answer"]) for line in lines]
    assert all(a is not None for a in parsed)
    assert all(normalize_number(a) == a for a in parsed if a is not None)
    # The worked solution's final "#### N" line must itself be extractable as the same answer.
    assert all(extract_answer(json.loads(line)["answer"]) == a for line, a in zip(lines, parsed, strict=True))


@needs_gsm8k
def test_gsm8k_known_items(gsm8k: GSM8KTask) -> None:
    p = gsm8k.get("train:0")
    assert p.id == "train:0" and p.answer == "72"
    assert p.messages[-1]["content"].startswith("Natalia sold clips to 48 of her friends")
    assert "#### <number>" in p.messages[-1]["content"]
    assert gsm8k.get("test:0").answer == "18"
    commas = [pr for pr in gsm8k.train if pr.answer == "109200000"]
    assert commas  # "109,200,000" in the file


@needs_gsm8k
def test_gsm8k_deterministic_and_disjoint(gsm8k: GSM8KTask) -> None:
    assert GSM8K_DIR is not None
    other = GSM8KTask(path=str(GSM8K_DIR))  # a directory works too
    for pid in ["train:0", "train:7472", "test:0", "test:1318"]:
        assert gsm8k.get(pid) == other.get(pid)
    assert gsm8k.spec() == other.spec()
    held = gsm8k.heldout(5000)
    assert len(held) == 1319 and held[:10] == gsm8k.heldout(10)
    assert not {p.question for p in gsm8k.train} & {p.question for p in gsm8k.test}
    rng = np.random.default_rng(0)
    assert all(gsm8k.sample_train(rng).id.startswith("train:") for _ in range(100))


@needs_gsm8k
def test_gsm8k_reward_exact(gsm8k: GSM8KTask) -> None:
    p = gsm8k.get("train:0")
    assert gsm8k.reward(p, "48 / 2 = 24 in May, 48 + 24 = 72.\n#### 72") == 1.0
    assert gsm8k.reward(p, "So she sold \\boxed{72} clips.") == 1.0
    assert gsm8k.reward(p, "The answer is 72.0") == 1.0
    assert gsm8k.reward(p, "48 + 24 = 72\n#### 73") == 0.0  # the marker wins over numbers in reasoning
    assert gsm8k.reward(p, "garbage") == 0.0
    assert gsm8k.reward(p, "") == 0.0
    big = next(pr for pr in gsm8k.train if pr.answer == "109200000")
    idx = gsm8k.train.index(big)
    assert gsm8k.reward(gsm8k.get(f"train:{idx}"), "#### $109,200,000") == 1.0


@needs_gsm8k
@pytest.mark.parametrize("bad_id", ["train:7473", "test:1319", "test:-1", "dev:0", "0", "train:00"])
def test_gsm8k_bad_ids(gsm8k: GSM8KTask, bad_id: str) -> None:
    with pytest.raises(PromptIdError, match=r"gsm8k: "):
        gsm8k.get(bad_id)


def test_gsm8k_boxed_format_and_system(tmp_path: Path) -> None:
    train = _write_jsonl(tmp_path / "train.jsonl", [{"question": "1+1?", "answer": "#### 2"}])
    task = get_task("gsm8k", path=str(train), answer_format="boxed", system="You are careful.")
    p = task.get("train:0")
    assert p.messages[0] == {"role": "system", "content": "You are careful."}
    assert "\\boxed{}" in p.messages[1]["content"] and "####" not in p.messages[1]["content"]
    with pytest.raises(ValueError, match="'answer_format'"):
        get_task("gsm8k", path=str(train), answer_format="xml")


def test_gsm8k_local_files_and_errors(tmp_path: Path) -> None:
    rows = [{"question": f"q{i}", "answer": f"work\n#### {i},000"} for i in range(3)]
    train = _write_jsonl(tmp_path / "mytrain.jsonl", rows)
    task = GSM8KTask(path=str(train))  # no test.jsonl beside it
    assert task.get("train:2").answer == "2000"
    assert task.heldout(0) == []
    with pytest.raises(ValueError, match="no test split"):
        task.heldout(1)
    with pytest.raises(PromptIdError, match="no test file"):
        task.get("test:0")
    test = _write_jsonl(tmp_path / "other.jsonl", rows[:1])
    assert GSM8KTask(path=str(train), test_path=str(test)).heldout(3)[0].answer == "0"
    with pytest.raises(ValueError, match="'test_path'"):
        GSM8KTask(path=str(train), test_path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="'path'"):
        GSM8KTask(path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="not both"):
        GSM8KTask(path=str(train), hf="openai/gsm8k")

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:3: not valid JSON"):
        GSM8KTask(path=str(bad))
    _write_jsonl(bad, [rows[0], {"question": "q", "answer": "no marker"}])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: answer does not end in"):
        GSM8KTask(path=str(bad))


def test_gsm8k_hub_without_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(RuntimeError, match=r"needs the 'datasets' package.*gsm8k:path="):
        get_task("gsm8k")


def test_gsm8k_hub_via_fake_datasets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rows = {
        "train": [{"question": "a?", "answer": "x\n#### 1,500"}, {"question": "b?", "answer": "#### -3"}],
        "test": [{"question": "c?", "answer": "#### 7"}],
    }
    calls: list[tuple[str, str, str]] = []

    def load_dataset(name: str, config: str, split: str) -> list[dict[str, str]]:
        calls.append((name, config, split))
        return rows[split]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    hub = GSM8KTask()
    assert calls == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test")]
    assert hub.get("train:0").answer == "1500" and hub.get("train:1").answer == "-3"
    # The same data from a local copy gives the same prompts and the same spec.
    train = _write_jsonl(tmp_path / "train.jsonl", rows["train"])
    _write_jsonl(tmp_path / "test.jsonl", rows["test"])
    local = GSM8KTask(path=str(train))
    assert local.heldout(1) == hub.heldout(1)
    data_keys = ["n_train", "n_test", "train_sha256", "test_sha256", "prompt_version", "answer_format"]
    assert {k: local.spec()[k] for k in data_keys} == {k: hub.spec()[k] for k in data_keys}
    assert hub.spec()["hf"] == "openai/gsm8k" and hub.spec()["hf_config"] == "main"
    # A worker that reads a local copy can check it against a contract written from the hub.
    checks = {k: hub.spec()[k] for k in data_keys}
    assert get_task("gsm8k", path=str(train), **checks).get("train:1") == hub.get("train:1")
    assert get_task("gsm8k", **hub.spec()).spec() == hub.spec()

    def failing(name: str, config: str, split: str) -> list[dict[str, str]]:
        raise ConnectionError("hub unreachable")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=failing))
    with pytest.raises(RuntimeError, match="could not load 'org/x'.*hub unreachable"):
        get_task("gsm8k", hf="org/x")


def test_gsm8k_is_a_task(tmp_path: Path) -> None:
    train = _write_jsonl(tmp_path / "train.jsonl", [{"question": "q", "answer": "#### 1"}])
    assert isinstance(GSM8KTask(path=str(train)), Task)
