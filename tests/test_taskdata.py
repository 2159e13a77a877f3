"""Task data through the bucket (issue 14, item 7): the trainer uploads the files a task's options name before
the contract, the contract names them by digest, and another machine rebuilds the same task from the bucket."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from stoa.bucket import open_bucket
from stoa.config import TrainerConfig
from stoa.contract import RunContract
from stoa.layout import contract_key, task_data_key
from stoa.tasks import SearchQATask, get_task
from stoa.tasks.data import TaskDataMismatch, localize_options, parse_ref, portable_task_data, upload_task_files

PROBLEMS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A box holds 12 pens; 5 are taken. How many are left?", "answer": "12 - 5 = 7\n#### 7"},
    {"question": "Sara reads 6 pages a day for 3 days. How many pages?", "answer": "6 * 3 = 18\n#### 18"},
]


def _jsonl(path: Path, rows: Sequence[Mapping[str, object]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def gsm8k_files(tmp_path: Path) -> Path:
    """A GSM8K train.jsonl with a test.jsonl beside it, in the trainer machine's own folder."""
    _jsonl(tmp_path / "trainer-data" / "test.jsonl", PROBLEMS[:1])
    return _jsonl(tmp_path / "trainer-data" / "train.jsonl", PROBLEMS)


def _cfg(url: str, **kw) -> TrainerConfig:
    base = dict(bucket=url, run="r", model="tiny", task="toy", n_samples=2, eval_n=0, kl_beta=0.0, anchor_every=100)
    return TrainerConfig(**{**base, **kw}).validate()


def _contract(cfg: TrainerConfig, task, data=None) -> RunContract:
    from stoa.models import resolve_model
    from stoa.tokenize import TextCodec
    from stoa.trainer.setup import build_contract

    model_dir = resolve_model("tiny")
    return build_contract(cfg, model_dir, task, TextCodec(model_dir), 512, task_data=data)


def test_the_trainer_uploads_the_data_before_a_contract_that_names_no_local_path(tmp_path, gsm8k_files, stoa_cache):
    from stoa.models import resolve_model
    from stoa.trainer.setup import ensure_contract

    url = str(tmp_path / "b")
    inner, order = open_bucket(url), []

    class Spy:
        def __getattr__(self, name):
            return getattr(inner, name)

        def put_create(self, key, data):
            order.append(key)
            return inner.put_create(key, data)

        def put_file(self, key, path, *, create_only=True):
            order.append(key)
            return inner.put_file(key, path, create_only=create_only)

    task = get_task("gsm8k", path=str(gsm8k_files))
    data = portable_task_data(task)
    spy: Any = Spy()
    contract = ensure_contract(spy, _contract(_cfg(url), task, data), resolve_model("tiny"), task_files=data.files)
    train, test = parse_ref(contract.task_spec["path"]), parse_ref(contract.task_spec["test_path"])
    assert train is not None and train.name == "train.jsonl"
    assert test is not None and test.name == "test.jsonl"
    keys = [task_data_key("r", ref.digest, ref.name) for ref in (train, test)]
    assert order[-1] == contract_key("r") and set(keys) <= set(order[:-1])
    assert inner.get(keys[0]) == gsm8k_files.read_bytes()
    stored = inner.get(contract_key("r")).decode()
    assert str(tmp_path) not in stored and "trainer-data" not in stored
    assert contract.task_spec["train_sha256"] == task.spec()["train_sha256"]  # the data checks stay


def test_another_machine_builds_the_same_task_from_the_bucket_alone(tmp_path, gsm8k_files, monkeypatch):
    bucket = open_bucket(str(tmp_path / "b"))
    task = get_task("gsm8k", path=str(gsm8k_files))
    data = portable_task_data(task)
    upload_task_files(bucket, "r", data.files)
    for f in data.files:
        f.path.unlink()  # the trainer's copy is gone: only the bucket has it
    monkeypatch.setenv("STOA_CACHE", str(tmp_path / "machine2"))
    opts = localize_options(bucket, "r", "gsm8k", data.spec)
    assert all(Path(str(opts[k])).is_relative_to(tmp_path / "machine2") for k in ("path", "test_path"))
    there = get_task("gsm8k", **opts)
    assert [there.get(i) for i in ("train:0", "train:2", "test:0")] == [task.get(i) for i in
                                                                          ("train:0", "train:2", "test:0")]
    assert portable_task_data(there).spec == data.spec  # the same contract spec, so the same fingerprint
    again = localize_options(bucket, "r", "gsm8k", data.spec)  # cached copies, verified, reused
    assert again == opts


def test_a_tampered_data_object_is_refused_and_never_used(tmp_path, gsm8k_files):
    bucket = open_bucket(str(tmp_path / "b"))
    data = portable_task_data(get_task("gsm8k", path=str(gsm8k_files)))
    upload_task_files(bucket, "r", data.files)
    ref = parse_ref(data.spec["path"])
    assert ref is not None
    key = task_data_key("r", ref.digest, ref.name)
    bucket.put(key, bucket.get(key).replace(b"#### 18", b"#### 19"))  # another answer, same size
    cache = tmp_path / "cache"
    with pytest.raises(TaskDataMismatch, match=r"task_spec\.path"):
        localize_options(bucket, "r", "gsm8k", data.spec, cache_dir=cache)
    assert not [p for p in cache.rglob("*") if p.is_file() and ref.digest in str(p)]  # nothing kept
    with pytest.raises(TaskDataMismatch, match="holds other bytes"):  # the trainer will not name it either
        upload_task_files(bucket, "r", data.files)
    bucket.delete(key)
    with pytest.raises(TaskDataMismatch, match="no task data object"):
        localize_options(bucket, "r", "gsm8k", data.spec, cache_dir=cache)


def test_a_corrupt_cached_copy_is_downloaded_again(tmp_path, gsm8k_files):
    bucket = open_bucket(str(tmp_path / "b"))
    data = portable_task_data(get_task("gsm8k", path=str(gsm8k_files)))
    upload_task_files(bucket, "r", data.files)
    cache = tmp_path / "cache"
    path = Path(str(localize_options(bucket, "r", "gsm8k", data.spec, cache_dir=cache)["path"]))
    path.write_text("garbage\n")
    assert Path(str(localize_options(bucket, "r", "gsm8k", data.spec, cache_dir=cache)["path"])).read_bytes() \
        == gsm8k_files.read_bytes()


def test_a_restarted_trainer_agrees_with_the_run_without_the_local_file(tmp_path, gsm8k_files, stoa_cache,
                                                                       monkeypatch):
    from stoa.trainer.loop import _Trainer
    from stoa.trainer.setup import resume_config

    url = str(tmp_path / "b")
    task_flag = f"gsm8k:path={gsm8k_files}"
    t1 = _Trainer(_cfg(url, task=task_flag), echo=lambda *_: None)
    run = RunContract.from_json(open_bucket(url).get(contract_key("r")))
    t1.close()
    same = resume_config(_cfg(url, task=task_flag), {"task": "--task"})  # the original --task agrees
    assert same.task == task_flag
    for name in ("train.jsonl", "test.jsonl"):
        (gsm8k_files.parent / name).unlink()
    monkeypatch.setenv("STOA_CACHE", str(tmp_path / "machine2"))  # a trainer on another box
    bare = TrainerConfig(bucket=url, run="r", model="tiny").validate()
    cfg = resume_config(bare, {"bucket": "--bucket", "run": "--run"}, echo=lambda *_: None)
    assert "bucket:" in cfg.task and str(tmp_path) not in cfg.task
    assert resume_config(_cfg(url, task=cfg.task), {"task": "--task"}).task == cfg.task  # the run's spec, given back
    t2 = _Trainer(cfg, echo=lambda *_: None)
    try:
        assert t2.contract.fingerprint() == run.fingerprint()
        assert t2.task.get("train:1") == get_task("gsm8k", **localize_options(
            open_bucket(url), "r", "gsm8k", run.task_spec)).get("train:1")
    finally:
        t2.close()


def test_searchqa_carries_its_three_files(tmp_path, monkeypatch):
    qa = [{"question": "who proposed contrastive search?", "golden_answers": ["Yixuan Su"]},
          {"question": "when was bm25 introduced?", "golden_answers": ["1994"]}]
    corpus = [{"id": "0", "title": "Contrastive search", "text": "Contrastive search was proposed by Yixuan Su."},
              {"id": "1", "title": "BM25", "text": "BM25 was introduced in 1994."}]
    src = tmp_path / "trainer-data"
    task = get_task("searchqa", path=str(_jsonl(src / "train.jsonl", qa)), test_path=str(_jsonl(src / "dev.jsonl",
                    qa[:1])), corpus=str(_jsonl(src / "corpus.jsonl", corpus)))
    bucket = open_bucket(str(tmp_path / "b"))
    data = portable_task_data(task)
    assert sorted(f.option for f in data.files) == ["corpus", "path", "test_path"]
    assert "trainer-data" not in json.dumps(data.spec)
    upload_task_files(bucket, "r", data.files)
    for f in data.files:
        f.path.unlink()
    monkeypatch.setenv("STOA_CACHE", str(tmp_path / "machine2"))
    there = get_task("searchqa", **localize_options(bucket, "r", "searchqa", data.spec))
    assert there.get("train:1") == task.get("train:1") and there.get("test:0") == task.get("test:0")
    assert isinstance(there, SearchQATask) and [d.text for d in there.corpus()] == [c["text"] for c in corpus]


def test_a_task_without_file_options_is_unchanged(tmp_path, stoa_cache):
    task = get_task("arithmetic", digits=2)
    contract = _contract(_cfg(str(tmp_path / "b"), task="arithmetic:digits=2"), task)
    before = dataclasses.replace(contract, task_spec=dict(task.spec()))  # how the contract was built before
    assert contract.to_json() == before.to_json()
    assert portable_task_data(task).files == ()
    assert localize_options(open_bucket(str(tmp_path / "b")), "r", "arithmetic", task.spec()) == task.spec()
    search = get_task("search")
    assert portable_task_data(search).spec == search.spec()  # its corpus is generated, its index travels apart


def test_task_data_key_is_content_addressed_and_refuses_odd_parts():
    digest = "ab" * 32
    assert task_data_key("r1", digest, "train.jsonl") == f"runs/r1/data/{digest}/train.jsonl"
    for bad_digest, bad_name in (("AB" * 32, "x"), ("ab", "x"), (digest, "../x"), (digest, ".hidden"), (digest, "")):
        with pytest.raises(ValueError, match="task data"):
            task_data_key("r1", bad_digest, bad_name)
    assert parse_ref(f"bucket:{digest}/train.jsonl") is not None
    assert [parse_ref(v) for v in (f"bucket:{digest}/a/b", f"bucket:{digest[:-1]}/x", "/data/train.jsonl", 3)] \
        == [None] * 4


def test_a_worker_on_another_machine_sets_up_the_runs_task(tmp_path, gsm8k_files, stoa_cache, tiny_dir, monkeypatch):
    from stoa.config import WorkerConfig, load_config
    from stoa.trainer.setup import ensure_contract
    from stoa.worker import loop

    url = str(tmp_path / "b")
    task = get_task("gsm8k", path=str(gsm8k_files))
    data = portable_task_data(task)
    ensure_contract(open_bucket(url), _contract(_cfg(url), task, data), tiny_dir, task_files=data.files)
    for f in data.files:
        f.path.unlink()
    monkeypatch.setenv("STOA_CACHE", str(tmp_path / "machine2"))
    cfg = load_config(WorkerConfig, env={}, overrides={"bucket": url, "run": "r", "name": "w", "model": str(tiny_dir),
                                                       "engine": "torch", "threads": 1, "wait_seconds": 1,
                                                       "log_dir": str(tmp_path / "logs")})
    w = loop._set_up(cfg, echo=lambda *_: None)
    assert w.task.get("train:2") == task.get("train:2") and w.task.get("test:0") == task.get("test:0")
    assert Path(w.task.train_source).is_relative_to(tmp_path / "machine2")
