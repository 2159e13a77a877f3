"""The dataset task (issue 26, deliverable 2): jsonl/parquet/directories, plain and conversational prompts,
TRL reward functions unchanged, extra columns, weights, the held-out split, spec round trips, the example."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stoa.tasks import TaskOptionError, get_task, load_task
from stoa.tasks.dataset import DatasetTask
from stoa.tasks.scoring import score_group
from tests.tasks.dataset_helpers import ADDITIONS, reward_module, write_jsonl

REPO = Path(__file__).resolve().parents[2]

RECORDER = """
CALLS = []

def record(prompts, completions, **kwargs):
    CALLS.append({"prompts": prompts, "completions": completions, **kwargs})
    return [float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]
"""

# The reward functions of TRL's GRPOTrainer documentation, as written there.
TRL_DOCS = r'''
import re

def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]

def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]

def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]
'''


def _load(spec: str) -> DatasetTask:
    task = load_task(spec)
    assert isinstance(task, DatasetTask)
    return task


@pytest.fixture
def additions(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "data" / "additions.jsonl", ADDITIONS)


def test_plain_prompts_with_the_built_in_exact_match_and_a_disjoint_hash_split(additions):
    task = _load(f"dataset:path={additions},system=Be brief.")
    assert isinstance(task, DatasetTask)
    assert len(task.train) + len(task.test) == 60 and task.test
    train_prompts = {r["prompt"] for r in task.train}
    assert not train_prompts & {r["prompt"] for r in task.test}
    p = task.get("train:0")
    user = {"role": "user", "content": task.train[0]["prompt"]}
    assert p.messages == ({"role": "system", "content": "Be brief."}, user)
    assert p.answer == task.train[0]["answer"]
    assert task.reward(p, f"so #### {p.answer}") == 1.0 and task.reward(p, "#### 1") == 0.0
    assert task.is_correct(p, f"The answer is {p.answer}.") and not task.is_correct(p, "no idea")
    assert [q.id for q in task.heldout(3)] == ["test:0", "test:1", "test:2"]
    assert task.sample_train(np.random.default_rng(0)).id.startswith("train:")


def test_the_hash_split_does_not_depend_on_row_order(tmp_path, additions):
    shuffled = write_jsonl(tmp_path / "shuffled.jsonl", ADDITIONS[::-1])
    a, b = get_task("dataset", path=str(additions)), get_task("dataset", path=str(shuffled))
    assert isinstance(a, DatasetTask) and isinstance(b, DatasetTask)
    assert {r["prompt"] for r in a.test} == {r["prompt"] for r in b.test}
    none = get_task("dataset", path=str(additions), test_fraction=0.0)
    assert isinstance(none, DatasetTask) and not none.test
    with pytest.raises(ValueError, match="test_path"):
        none.heldout(1)


def test_a_non_numeric_answer_must_equal_the_whole_completion(tmp_path):
    path = write_jsonl(tmp_path / "caps.jsonl", [{"prompt": "Capital of France?", "answer": "Paris"}])
    task = get_task("dataset", path=str(path), test_fraction=0.0)
    p = task.get("train:0")
    assert task.reward(p, "  Paris\n") == 1.0 and task.reward(p, "It is Paris") == 0.0


def test_a_directory_a_parquet_file_and_the_spec_round_trip(tmp_path):
    pytest.importorskip("pyarrow", reason="parquet needs pyarrow (stoa[data])")
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "d"
    write_jsonl(folder / "train.jsonl", ADDITIONS[:40])
    write_jsonl(folder / "test.jsonl", ADDITIONS[40:])
    task = get_task("dataset", path=str(folder))
    spec = task.spec()
    assert spec["path"] == str(folder / "train.jsonl") and spec["test_path"] == str(folder / "test.jsonl")
    assert (spec["n_train"], spec["n_test"]) == (40, 20)
    assert get_task(task.id, **spec).spec() == spec
    pq.write_table(pa.Table.from_pylist(ADDITIONS[:40]), tmp_path / "train.parquet")
    from_parquet = get_task("dataset", path=str(tmp_path / "train.parquet"), test_path=str(folder / "test.jsonl"))
    assert from_parquet.spec()["train_sha256"] == spec["train_sha256"]
    for name, bad in (("n_train", 41), ("train_sha256", "0" * 64), ("test_sha256", "")):
        with pytest.raises(TaskOptionError, match=f"option '{name}'.*another copy"):
            get_task(task.id, **{**spec, name: bad})


def test_conversational_prompts_and_trl_doc_functions_unchanged(tmp_path, monkeypatch):
    mod = reward_module(tmp_path, monkeypatch, TRL_DOCS)
    rows = [{"prompt": [{"role": "system", "content": "Think first."}, {"role": "user", "content": f"{i} + 1?"}],
             "solution": str(i + 1)} for i in range(8)]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    task = _load(f"dataset:path={path},test_fraction=0,reward={mod}:format_reward_func*2")
    p = task.get("train:3")
    assert p.messages == tuple(rows[3]["prompt"]) and p.answer == ""
    good = "<think>3+1</think><answer>4</answer>"
    assert score_group(task, p, [good, "4", f"{good}!"]) == [2.0, 0.0, 0.0]
    assert task.is_correct(p, good) and not task.is_correct(p, "4")
    plain = write_jsonl(tmp_path / "boxed.jsonl", [{"prompt": "2+2?", "ground_truth": "4"}])
    boxed = get_task("dataset", path=str(plain), test_fraction=0.0, reward=(f"{mod}:reward_func", f"{mod}:reward_len"))
    q = boxed.get("train:0")
    texts = ["\\boxed{4}", "\\boxed{5}", "4"]
    assert score_group(boxed, q, texts) == [1.0 - 11, 0.0 - 11, 0.0 - 19]
    boxed = get_task("dataset", path=str(plain), test_fraction=0.0, reward=(f"{mod}:reward_func",))
    assert boxed.is_correct(q, "so \\boxed{4}")


def test_every_other_column_reaches_the_function_once_per_group(tmp_path, monkeypatch, additions):
    mod = reward_module(tmp_path, monkeypatch, RECORDER)
    task = _load(f"dataset:path={additions},reward={mod}:record")
    calls = sys.modules[mod].CALLS
    assert len(calls) == 1 and calls[0]["completions"] == ["", "The answer is 0."]  # the start-up probe
    p = task.get("train:5")
    row = task.train[5]
    assert score_group(task, p, ["ab", "abcd", "a"]) == [2.0, 4.0, 1.0]
    call = calls[-1]
    assert set(call) == {"prompts", "completions", "answer", "level"} and len(calls) == 2
    assert call["prompts"] == [row["prompt"]] * 3 and call["completions"] == ["ab", "abcd", "a"]
    assert call["answer"] == [row["answer"]] * 3 and call["level"] == [row["level"]] * 3


def test_weights_multiply_and_rewards_sum(tmp_path, monkeypatch, additions):
    mod = reward_module(tmp_path, monkeypatch, """
        def one(completions, **kw):
            return (1.0 for _ in completions)  # any iterable, as TRL takes it

        def length(completions, **kw):
            return [len(c) for c in completions]
    """)
    task = _load(f"dataset:path={additions},reward={mod}:one*0.25,reward={mod}:length*-2,reward={mod}:one")
    assert score_group(task, task.get("train:0"), ["", "xyz"]) == [1.25, 1.25 - 6.0]
    assert task.code_modules() == (mod,)
    spec = json.loads(json.dumps(task.spec()))  # as the run contract carries it
    assert spec["reward"] == [f"{mod}:one*0.25", f"{mod}:length*-2", f"{mod}:one"]
    assert get_task(task.id, **spec).spec() == task.spec()


def test_a_function_without_kwargs_gets_only_the_keywords_it_names(tmp_path, monkeypatch, additions):
    mod = reward_module(tmp_path, monkeypatch, """
        import numpy as np

        def strict(completions, answer, completion_ids=None):
            return np.array([float(c.strip() == a) for c, a in zip(completions, answer)])
    """)
    task = get_task("dataset", path=str(additions), reward=(f"{mod}:strict",))
    p = task.get("test:0")
    assert score_group(task, p, [p.answer, "x"]) == [1.0, 0.0]


def test_the_task_code_records_the_reward_module(tmp_path, monkeypatch, additions):
    from stoa.tasks.code import identify, task_code

    mod = reward_module(tmp_path, monkeypatch, "def r(completions, **kw):\n    return [0.0] * len(completions)\n")
    task = _load(f"dataset:path={additions},reward={mod}:r")
    (code,) = task_code(task)
    assert (code.module, code.dist, code.version) == (mod, "", "")
    (tmp_path / f"{mod}.py").write_text("def r(completions, **kw):\n    return [1.0] * len(completions)\n")
    changed = identify(mod)
    assert changed is not None and changed.sha256 != code.sha256
    assert task_code(get_task("dataset", path=str(additions))) == ()  # the built-in reward is stoa's own


def test_a_worker_rebuilds_the_same_task_from_the_bucket_and_accepts_only_references(tmp_path):
    pytest.importorskip("pyarrow", reason="parquet needs pyarrow (stoa[data])")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stoa.bucket import open_bucket
    from stoa.tasks.data import (
        TaskDataRefused,
        contract_refs,
        localize_contract_options,
        parse_ref,
        portable_task_data,
        upload_task_files,
    )

    folder = tmp_path / "mine"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(ADDITIONS[:45]), folder / "train.parquet")
    write_jsonl(folder / "test.jsonl", ADDITIONS[45:])
    task = get_task("dataset", path=str(folder))
    data = portable_task_data(task)
    refs = [parse_ref(data.spec[o]) for o in ("path", "test_path")]
    assert [r.name for r in refs if r] == ["train.parquet", "test.jsonl"]
    bucket = open_bucket(str(tmp_path / "bucket"))
    upload_task_files(bucket, "r", data.files)
    local = localize_contract_options(bucket, "r", "dataset", data.spec, cache_dir=tmp_path / "worker-cache")
    assert str(local["path"]).startswith(str(tmp_path / "worker-cache"))
    assert portable_task_data(get_task("dataset", **local)).spec == data.spec
    with pytest.raises(TaskDataRefused, match="absolute path"):
        contract_refs("dataset", {**data.spec, "path": str(folder / "train.parquet")})


def test_the_tutorial_example_loads_from_its_directory(tmp_path, monkeypatch):
    example = REPO / "examples" / "your-task"
    subprocess.run([sys.executable, str(example / "make_problems.py")], cwd=tmp_path, check=True)
    assert (tmp_path / "problems.jsonl").read_bytes() == (example / "problems.jsonl").read_bytes()
    monkeypatch.syspath_prepend(str(example))
    monkeypatch.chdir(example)
    monkeypatch.delitem(sys.modules, "reward", raising=False)
    task = _load("dataset:path=problems.jsonl,reward=reward:correct")
    assert (len(task.train), len(task.test)) == (274, 26)
    p = task.heldout(1)[0]
    assert score_group(task, p, [f"It is {p.answer}", "It is 1000", ""]) == [1.0, 0.0, 0.0]
    sys.modules.pop("reward", None)


def test_a_function_that_mutates_its_arguments_cannot_change_the_dataset(tmp_path, monkeypatch):
    mod = reward_module(tmp_path, monkeypatch, """
        def vandal(prompts, completions, meta, **kw):
            for p, m in zip(prompts, meta):
                p[0]["content"] = "changed"
                m["k"] = "changed"
            return [1.0] * len(completions)
    """)
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "meta": {"k": "v"}}]
    task = get_task("dataset", path=str(write_jsonl(tmp_path / "m.jsonl", rows)), test_fraction=0.0,
                    reward=(f"{mod}:vandal",))
    before = task.spec()
    assert score_group(task, task.get("train:0"), ["a", "b"]) == [1.0, 1.0]
    assert task.get("train:0").messages == ({"role": "user", "content": "hi"},)
    assert isinstance(task, DatasetTask) and task.train[0]["meta"] == {"k": "v"} and task.spec() == before
