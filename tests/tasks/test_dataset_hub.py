"""The dataset task from a Hugging Face hub id (``hf=owner/name``), through a stand-in ``datasets`` module: the
package is optional and this machine has no network."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from stoa.tasks import TaskDataError, TaskOptionError, get_task, load_task
from stoa.tasks.dataset import DatasetTask
from tests.tasks.dataset_helpers import ADDITIONS


def _fake_datasets(monkeypatch: pytest.MonkeyPatch, splits: dict[str, list[dict[str, Any]]] | Exception) -> list:
    calls: list[tuple[str, Any]] = []

    def load_dataset(name: str, config: Any = None) -> dict[str, list[dict[str, Any]]]:
        calls.append((name, config))
        if isinstance(splits, Exception):
            raise splits
        return splits

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


def test_a_hub_dataset_with_a_test_split_round_trips(monkeypatch):
    calls = _fake_datasets(monkeypatch, {"train": ADDITIONS[:40], "test": ADDITIONS[40:]})
    task = load_task("dataset:hf=me/additions,hf_config=main")
    assert isinstance(task, DatasetTask) and (len(task.train), len(task.test)) == (40, 20)
    assert calls == [("me/additions", "main")]
    spec = task.spec()
    assert spec["hf"] == "me/additions" and spec["hf_config"] == "main" and "path" not in spec
    assert get_task("dataset", **spec).spec() == spec
    p = task.get("test:0")
    assert task.reward(p, f"#### {ADDITIONS[40]['answer']}") == 1.0


def test_a_hub_dataset_without_a_test_split_is_split_by_hash(monkeypatch):
    calls = _fake_datasets(monkeypatch, {"train": ADDITIONS})
    task = get_task("dataset", hf="me/additions")
    assert isinstance(task, DatasetTask) and len(task.train) + len(task.test) == 60 and task.test
    assert calls == [("me/additions", None)]


def test_a_worker_accepts_only_a_hub_id_in_hf(monkeypatch):
    from stoa.tasks.data import TaskDataRefused, contract_refs

    assert contract_refs("dataset", {"hf": "me/additions"}) == {}
    with pytest.raises(TaskDataRefused, match="as a hub dataset"):
        contract_refs("dataset", {"hf": "/home/me/secrets"})


@pytest.mark.parametrize(("splits", "error", "match"), [
    (ConnectionError("no route to host\nmore"), TaskDataError, r"could not load 'me/x' from the hub \(no route to "
                                                               r"host\); or save it as jsonl"),
    ({"validation": ADDITIONS}, TaskOptionError, r"has no 'train' split \(its splits: \['validation'\]\)"),
])
def test_hub_failures_are_one_line(monkeypatch, splits, error, match):
    _fake_datasets(monkeypatch, splits)
    with pytest.raises(error, match=match) as e:
        get_task("dataset", hf="me/x")
    assert "\n" not in str(e.value)


def test_without_the_datasets_package_the_fix_is_named(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(TaskDataError, match=r"needs the 'datasets' package \(pip install 'stoa\[datasets\]'\)"):
        get_task("dataset", hf="me/x")
    with pytest.raises(TaskOptionError, match="exactly one"):
        get_task("dataset", hf="me/x", path=str(tmp_path))
    with pytest.raises(TaskOptionError, match="'test_path' goes with 'path'"):
        get_task("dataset", hf="me/x", test_path=str(tmp_path))
