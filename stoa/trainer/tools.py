"""The trainer's side of multi-turn tasks: its own tools (to replay every recorded episode) and the run's index.

A search task's index is the trainer's choice: ``--retriever DIR`` (``stoa retriever index``), an endpoint URL,
or (built-in corpora) an index built once from ``task.corpus()`` and cached. A directory index travels to the
workers through the bucket under ``runs/<run>/retriever/<fingerprint>/``; its fingerprint goes in the contract,
so every worker and the trainer search the same corpus.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stoa.bucket import Bucket
from stoa.contract import canonical_json, digest_hex
from stoa.envs import Tools
from stoa.envs.tools import is_url


@dataclass
class TrainerTools:
    """What a multi-turn task gives the trainer."""

    tools: Tools | None = None
    """The tools replays and evaluations run (None: a single-turn task)."""
    retriever: dict[str, Any] = field(default_factory=dict)
    """The contract's ``retriever`` block (``fingerprint``), empty without a search index."""


def prepare_tools(task: Any, retriever: str, bucket: Bucket, run_id: str,
                  echo: Callable[[str], Any] = print) -> TrainerTools:
    """The trainer's tools for ``task``, uploading a search task's index to the run first.

    Args:
        task: the run's task.
        retriever: the ``retriever`` setting (URL, index directory, or empty).
        bucket: the run's bucket.
        run_id: the run.
        echo: where progress lines go.
    """
    from stoa.tasks.multiturn import is_multiturn

    if not is_multiturn(task):
        return TrainerTools()
    if task.tool_kind != "search":
        return TrainerTools(task.make_tools(None))
    from stoa.retrieval import BM25Index, HTTPSearcher, upload_index

    if is_url(retriever):
        searcher = HTTPSearcher(retriever, note=echo)
        echo(f"[trainer] retriever {retriever} (corpus {searcher.fingerprint})")
        return TrainerTools(task.make_tools(searcher), {"fingerprint": searcher.fingerprint})
    index_dir = Path(retriever) if retriever else task_index(task, echo)
    fingerprint = upload_index(bucket, run_id, index_dir)
    echo(f"[trainer] retriever index {index_dir} (corpus {fingerprint}) in the run's bucket")
    return TrainerTools(task.make_tools(BM25Index.load(index_dir, mmap=True)), {"fingerprint": fingerprint})


def task_index(task: Any, echo: Callable[[str], Any] = print, cache: Path | None = None) -> Path:
    """The index of a task's own corpus (``task.corpus()``), built once per task spec and cached.

    Args:
        task: a search task with ``corpus()``.
        echo: where progress lines go.
        cache: the cache directory (default: the retriever cache, ``built/<spec hash>``).
    """
    from stoa.retrieval import BadIndex, BM25Index, default_index_cache, verify_index_dir

    if not hasattr(task, "corpus"):
        raise ValueError(f"retriever: task {task.id!r} has no built-in corpus; index one with 'stoa retriever "
                         "index CORPUS.jsonl DIR' and give --retriever DIR")
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
    echo(f"[trainer] indexed the {task.id} corpus in {time.perf_counter() - t0:.1f}s -> {root}")
    return root
