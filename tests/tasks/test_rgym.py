"""The reasoning-gym adapter: ids rebuilt from the id alone, held-out split disjoint, reasoning-gym's rewards."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym is an optional extra (pip install reasoning-gym)")

from stoa.tasks import TaskOptionError, get_task, load_task  # noqa: E402
from stoa.tasks.base import PromptIdError  # noqa: E402
from stoa.tasks.code import task_modules  # noqa: E402
from stoa.tasks.rgym import ReasoningGymTask  # noqa: E402

SPEC = "rg:leg_counting,size=50,seed=3"


def _tagged(answer: str) -> str:
    return f"Let me count.\n<answer>{answer}</answer>"


def test_spec_round_trip_through_load_task():
    task = load_task(SPEC)
    assert isinstance(task, ReasoningGymTask)
    spec = task.spec()
    assert (spec["dataset"], spec["size"], spec["seed"]) == ("leg_counting", 50, 3)
    again = get_task(task.id, **spec)
    assert again.spec() == spec
    for pid in ("train:0", "train:49", "test:0", "test:7"):
        assert again.get(pid) == task.get(pid)


def test_ids_stable_across_task_objects_and_seeds_matter():
    a, b = load_task(SPEC), load_task(SPEC)
    assert [a.get(f"train:{i}") for i in range(10)] == [b.get(f"train:{i}") for i in range(10)]
    assert a.heldout(5) == b.heldout(5)
    other = load_task("rg:leg_counting,size=50,seed=4")
    assert other.get("train:0").messages != a.get("train:0").messages
    assert a.get("train:0").messages[0]["role"] == "system" and "<answer>" in a.get("train:0").messages[0]["content"]


def test_ids_past_a_split_are_refused():
    task = load_task(SPEC)
    with pytest.raises(PromptIdError, match="past the train split"):
        task.get("train:50")
    with pytest.raises(PromptIdError):
        task.get("valid:0")
    rng = np.random.default_rng(0)
    assert all(int(task.sample_train(rng).id.split(":")[1]) < 50 for _ in range(200))


def test_heldout_questions_are_not_training_questions():
    # 1-2 animals of 1-2 kinds: a space of a few thousand questions, so chance repeats are common
    small = "rg:leg_counting,size=2000,test_size=100,config=min_animals:1,config=max_animals:2,config=max_instances:2"
    task = load_task(small)
    train = {task.get(f"train:{i}").messages[-1]["content"] for i in range(2000)}
    held = [p.messages[-1]["content"] for p in task.heldout(100)]
    assert len(held) == 100 and not set(held) & train
    raw = load_task(small + ",disjoint=false")  # without the check some held-out questions are training ones
    assert set(p.messages[-1]["content"] for p in raw.heldout(100)) & train


def test_a_space_too_small_for_a_disjoint_split_is_one_line():
    task = load_task("rg:leg_counting,size=2000,test_size=50,config=min_animals:1,config=max_animals:1,"
                     "config=max_instances:1")
    with pytest.raises(TaskOptionError, match="only .* held-out questions"):
        task.heldout(50)


def test_reward_of_correct_and_wrong_completions():
    task = load_task(SPEC)
    p = task.get("test:3")
    assert task.reward(p, _tagged(p.answer)) == 1.0 and task.is_correct(p, _tagged(p.answer))
    wrong = str(int(p.answer) + 1)
    assert task.reward(p, _tagged(wrong)) == 0.0 and not task.is_correct(p, _tagged(wrong))
    assert task.reward(p, f"The answer is {p.answer}.") == 0.0  # reasoning-gym's way: no tag, no answer
    lenient = load_task(SPEC + ",extract=number")
    assert lenient.reward(p, f"The answer is {p.answer}.") == 1.0
    assert lenient.reward(p, f"{p.answer} <answer>{wrong}</answer>") == 0.0  # a tag wins over the last number


def test_reward_version_and_code_modules_name_reasoning_gym():
    import importlib.metadata

    task = load_task(SPEC)
    assert task.reward_version.endswith("rg" + importlib.metadata.version("reasoning-gym"))
    assert task_modules(task) == ("reasoning_gym",)


@pytest.mark.parametrize(("spec", "match"), [
    ("rg:leg_countin", "unknown reasoning-gym dataset 'leg_countin'; did you mean leg_counting"),
    ("rg:", "option 'dataset' is required"),
    ("rg:leg_counting,config=legs:3", r"unknown config key 'legs'; valid keys: \['max_animals'"),
    ("rg:leg_counting,config=min_animals:x", "config min_animals:'x'"),
    ("rg:leg_counting,config=min_animals:0", "refuses the config .*min_animals must be positive"),
    ("rg:leg_counting,config=seed:1", "option seed="),
    ("rg:leg_counting,config=min_animals", "must be key:value"),
    ("rg:leg_counting,extract=json", "option 'extract' must be one of"),
    ("rg:leg_counting,size=0", "option 'size' must be in"),
])
def test_bad_names_and_options_are_one_line(spec, match):
    with pytest.raises(TaskOptionError, match=match) as e:
        load_task(spec)
    assert "\n" not in str(e.value)


def test_config_values_are_coerced_to_the_field_types():
    one = load_task("rg:leg_counting,size=20,config=min_animals:1,config=max_animals:1")
    assert isinstance(one, ReasoningGymTask)
    assert all(len(one.entry(f"train:{i}")["metadata"]["animals"]) == 1 for i in range(20))
    times = load_task("rg:basic_arithmetic,size=20,config=operators:*,config=format_style:simple,"
                      "config=allow_parentheses:false,config=min_terms:2,config=max_terms:2")
    questions = [times.get(f"train:{i}").messages[-1]["content"] for i in range(20)]
    assert all(" * " in q and " + " not in q for q in questions)
    with pytest.raises(TaskOptionError, match=r"format_style:'fancy' must be one of \['simple', 'natural'\]"):
        load_task("rg:basic_arithmetic,config=format_style:fancy")


def test_a_machine_that_generates_other_entries_refuses():
    spec = load_task(SPEC).spec()
    with pytest.raises(TaskOptionError, match="other entries than the run's"):
        get_task("rg", **{**spec, "fingerprint": "0" * 16})


def test_hash_seeded_generators_need_a_fixed_hash_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(TaskOptionError, match="PYTHONHASHSEED=0"):
        load_task("rg:word_ladder")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert load_task("rg:word_ladder,size=5").get("train:0").answer


def test_the_default_test_seed_is_far_from_the_training_indices():
    # reasoning-gym draws entry i from Random(seed + i): test_seed = seed + 1 would repeat train:1.. as test:0..
    task = load_task("rg:leg_counting,size=50,seed=3,disjoint=false")
    train = {task.get(f"train:{i}").messages[-1]["content"] for i in range(50)}
    assert not train & {p.messages[-1]["content"] for p in task.heldout(50)}
    near = load_task("rg:leg_counting,size=50,seed=3,disjoint=false,test_seed=4")
    assert len(train & {p.messages[-1]["content"] for p in near.heldout(50)}) == 49
