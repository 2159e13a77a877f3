"""Opening a task's tools, one way for every role: the worker, the trainer, the evaluator, local mode, benches.

Local tools (``walk``) come from the task. A search task's searcher is, in order: the endpoint or index
directory named by the ``retriever`` setting; else the run's index from the bucket (the contract's
``retriever.fingerprint``); else an index of the task's own corpus (``task.corpus()``), built once per task
spec and cached on disk, or built in memory. The trainer publishes its index: a directory index goes up to
the run's bucket under ``runs/<run>/retriever/<fingerprint>/`` and its fingerprint goes in the contract, so
every worker and the trainer search the same corpus.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from stoa.contract import canonical_json, digest_hex
from stoa.envs.base import Tools
from stoa.retrieval import (
    BadIndex,
    BM25Index,
    Searcher,
    default_index_cache,
    open_searcher,
    upload_index,
    verify_index_dir,
)
from stoa.tasks.multiturn import is_multiturn

__all__ = ["CORPUS_INDEX", "TaskTools", "is_url", "open_task_tools", "task_index"]

CorpusIndex = Literal["none", "cached", "memory"]
CORPUS_INDEX: tuple[CorpusIndex, ...] = ("none", "cached", "memory")
"""Whether a search task without a retriever or a bucket index searches its own corpus: no (the worker and
the evaluator refuse), an index built once and cached on disk (the trainer, local mode), or one built in
memory each time (benches)."""


@dataclass(frozen=True)
class TaskTools:
    """A task's tools and, for the trainer, the contract's ``retriever`` block."""

    tools: Tools | None = None
    """The tools episodes, replays and evaluations run (None: a single-turn task)."""
    retriever: dict[str, Any] = field(default_factory=dict)
    """The contract's ``retriever`` block (``fingerprint``) when published, else empty."""


def is_url(retriever: str) -> bool:
    """Whether a ``retriever`` setting names an endpoint (``http://`` or ``https://``) rather than a directory.

    Args:
        retriever: the setting.
    """
    return retriever.startswith(("http://", "https://"))


def open_task_tools(task: Any, retriever: str = "", *, role: str, bucket: Any = None,
                    run_id: str | None = None, spec: Mapping[str, Any] | None = None, publish: bool = False,
                    corpus: CorpusIndex = "none", note: Callable[[str], Any] = print) -> TaskTools:
    """The tools of a task (None for a single-turn task).

    Args:
        task: the task (``tool_kind``, ``make_tools``; a search task's ``corpus()`` when ``corpus`` allows it).
        retriever: the ``retriever`` setting: an endpoint URL, an index directory, or empty.
        role: the caller's label in progress lines (``trainer``, ``local``, ``bench``).
        bucket: the run's bucket (to download the run's index, or to publish one).
        run_id: the run.
        spec: the contract's ``retriever`` (``fingerprint``): the corpus every endpoint or directory must serve.
        publish: upload a directory index to the run and give its fingerprint in ``TaskTools.retriever`` (the
            trainer).
        corpus: how a search task without a retriever or a bucket index gets one (``CORPUS_INDEX``).
        note: where waiting, download and indexing lines go.

    Raises:
        BadIndex: a search task without any way to reach its index (names the setting to give; a ``ValueError``).
        ValueError: the task has no built-in corpus to index (names the command that indexes one), or
            ``publish`` without a bucket and a run.
    """
    if not is_multiturn(task):
        return TaskTools()
    if task.tool_kind != "search":
        return TaskTools(task.make_tools(None))
    fingerprint = (spec or {}).get("fingerprint") or None
    url = retriever if is_url(retriever) else ""
    index_dir = Path(retriever) if retriever and not url else None
    if not retriever and bucket is not None and fingerprint is not None:
        return TaskTools(task.make_tools(open_searcher(bucket=bucket, run_id=run_id, fingerprint=fingerprint,
                                                       note=note)))
    if not retriever and corpus == "memory":
        return TaskTools(task.make_tools(_memory_index(task, role, note)))
    if not retriever and corpus == "cached":
        index_dir = task_index(task, role, note)
    if not url and index_dir is None:
        raise BadIndex("retriever: a search task needs an index; give --retriever URL or an index directory "
                       "(stoa retriever index CORPUS.jsonl DIR)")
    block: dict[str, Any] = {}
    if publish and index_dir is not None:
        if bucket is None or not run_id:
            raise ValueError("publish: the index goes to the run's bucket; pass bucket and run_id")
        block["fingerprint"] = upload_index(bucket, run_id, index_dir)
        note(f"[{role}] retriever index {index_dir} (corpus {block['fingerprint']}) in the run's bucket")
    searcher = open_searcher(url=url or None, index_dir=index_dir, fingerprint=fingerprint, note=note)
    if publish and url:
        block["fingerprint"] = searcher.fingerprint
        note(f"[{role}] retriever {url} (corpus {searcher.fingerprint})")
    return TaskTools(task.make_tools(searcher), block)


def task_index(task: Any, role: str, note: Callable[[str], Any] = print, cache: Path | None = None) -> Path:
    """The index of a task's own corpus (``task.corpus()``), built once per task spec and cached.

    Args:
        task: a search task with ``corpus()``.
        role: the caller's label in the indexing line.
        note: where the indexing line goes.
        cache: the cache directory (default: the retriever cache, ``built/<spec hash>``).

    Raises:
        ValueError: the task has no built-in corpus.
    """
    _need_corpus(task)
    spec = {k: v for k, v in dict(task.spec()).items() if k != "index"}
    root = (cache or default_index_cache() / "built") / digest_hex(canonical_json([task.id, spec]))[:16]
    try:
        verify_index_dir(root)
        return root
    except (BadIndex, OSError):
        pass
    t0 = time.perf_counter()
    index = BM25Index.build(task.corpus())
    index.save(root)
    note(f"[{role}] indexed the {task.id} corpus in {time.perf_counter() - t0:.1f}s -> {root}")
    return root


def _memory_index(task: Any, role: str, note: Callable[[str], Any]) -> Searcher:
    """An index of the task's own corpus built in memory (nothing cached)."""
    _need_corpus(task)
    t0 = time.perf_counter()
    index = BM25Index.build(task.corpus())
    note(f"[{role}] indexed the {task.id} corpus in {time.perf_counter() - t0:.2f}s")
    return index


def _need_corpus(task: Any) -> None:
    """Refuse a task without a built-in corpus (ValueError naming the command that indexes one)."""
    if not hasattr(task, "corpus"):
        raise ValueError(f"retriever: task {task.id!r} has no built-in corpus; index one with 'stoa retriever "
                         "index CORPUS.jsonl DIR' and give --retriever DIR")
