"""``open_task_tools``: one way to open a task's tools for every role (trainer, worker, evaluator, local, bench)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from stoa.bucket import open_bucket
from stoa.episodes.task_tools import TaskTools, open_task_tools, task_index
from stoa.layout import retriever_file_key
from stoa.retrieval import BadIndex, BM25Index
from stoa.retrieval.bm25 import INDEX_MANIFEST
from stoa.tasks import get_task

RUN = "r1"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty retriever cache of this test only."""
    monkeypatch.setenv("STOA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "retriever"


def test_a_single_turn_task_has_no_tools_and_a_local_one_never_publishes(tmp_path, cache):
    bucket = open_bucket(str(tmp_path / "b"))
    assert open_task_tools(get_task("arithmetic"), role="trainer", bucket=bucket, run_id=RUN,
                           publish=True) == TaskTools()
    walk = open_task_tools(get_task("walk"), role="trainer", bucket=bucket, run_id=RUN, publish=True,
                           corpus="cached")
    assert walk.tools is not None and walk.retriever == {}
    assert not cache.exists() and list(bucket.list("")) == []


def test_the_trainer_publishes_its_cached_index_and_a_worker_opens_the_same_one(tmp_path, cache):
    task, lines = get_task("search"), []
    bucket = open_bucket(str(tmp_path / "b"))
    trainer = open_task_tools(task, role="trainer", bucket=bucket, run_id=RUN, publish=True, corpus="cached",
                              note=lines.append)
    fp = trainer.retriever["fingerprint"]
    built = task_index(task, "trainer")  # cached: the same directory, not rebuilt
    assert BM25Index.load(built).fingerprint == fp and bucket.exists(retriever_file_key(RUN, fp, INDEX_MANIFEST))
    assert lines[0].startswith(f"[trainer] indexed the {task.id} corpus") and lines[1].startswith(
        f"[trainer] retriever index {built} (corpus {fp})")
    worker = open_task_tools(task, role="worker", bucket=bucket, run_id=RUN, spec=trainer.retriever,
                             note=lambda _: None)
    assert worker.retriever == {} and worker.tools is not None and trainer.tools is not None
    assert worker.tools.fingerprint == fp == trainer.tools.fingerprint  # type: ignore[attr-defined]
    assert (cache / fp).is_dir()  # the worker downloaded the run's index by its fingerprint
    with pytest.raises(ValueError, match="pass bucket and run_id"):
        open_task_tools(task, role="trainer", publish=True, corpus="cached")


def test_the_role_labels_the_lines_and_a_memory_index_writes_nothing(cache):
    task, lines = get_task("search"), []
    bench = open_task_tools(task, role="bench", corpus="memory", note=lines.append)
    assert bench.tools is not None and lines[0].startswith("[bench] indexed") and not cache.exists()
    local = open_task_tools(task, role="local", corpus="cached", note=lines.append)
    assert local.tools is not None and local.retriever == {} and lines[1].startswith("[local] indexed")
    assert bench.tools.fingerprint == local.tools.fingerprint  # type: ignore[attr-defined]
    assert [p.parent.name for p in cache.glob("*/*")] == ["built"]  # local mode's index, cached once


def test_a_worker_without_an_index_is_refused_before_anything_is_written(tmp_path, cache):
    with pytest.raises(BadIndex, match="give --retriever URL or an index directory"):
        open_task_tools(get_task("search"), role="worker", bucket=open_bucket(str(tmp_path / "b")), run_id=RUN,
                        spec={})
    assert not cache.exists()


def test_a_search_task_without_a_corpus_names_the_index_command(cache):
    search: Any = get_task("search")
    task = SimpleNamespace(id="bare", tool_kind="search", limits=search.limits, make_env=search.make_env,
                           make_tools=search.make_tools)  # a search task without corpus()
    for corpus in ("cached", "memory"):
        with pytest.raises(ValueError, match="stoa retriever index CORPUS.jsonl DIR"):
            open_task_tools(task, role="local", corpus=corpus)
    assert not cache.exists()
