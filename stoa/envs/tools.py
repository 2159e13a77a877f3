"""Opening a task's tools on any machine: a local index, a shared endpoint, or the run's index in the bucket."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from stoa.envs.base import Tools


def is_url(retriever: str) -> bool:
    """Whether a ``retriever`` setting names an endpoint (``http://`` or ``https://``) rather than a directory.

    Args:
        retriever: the setting.
    """
    return retriever.startswith(("http://", "https://"))


def open_tools(task: Any, retriever: str = "", *, bucket: Any = None, run_id: str | None = None,
               spec: Mapping[str, Any] | None = None, note: Callable[[str], Any] = print) -> Tools:
    """The tools of a multi-turn task.

    Local tools come from the task; a search task's searcher is, in order: the endpoint or index directory
    named by ``retriever``, else the run's index from the bucket (``spec["fingerprint"]``, the contract's
    ``retriever``). With a fingerprint, an endpoint or directory serving another corpus is refused.

    Args:
        task: a multi-turn task (``tool_kind``, ``make_tools``).
        retriever: a URL, an index directory, or empty.
        bucket: the run's bucket (to download the index).
        run_id: the run.
        spec: the contract's ``retriever`` (``fingerprint``).
        note: where waiting and download messages go.

    Raises:
        BadIndex: a search task without any way to reach its index (names the setting to give; a ``ValueError``).
    """
    if task.tool_kind != "search":
        return task.make_tools(None)
    from stoa.retrieval import BadIndex, open_searcher

    fingerprint = (spec or {}).get("fingerprint") or None
    if not retriever and (bucket is None or fingerprint is None):
        raise BadIndex("retriever: a search task needs an index; give --retriever URL or an index directory "
                         "(stoa retriever index CORPUS.jsonl DIR)")
    searcher = open_searcher(url=retriever if is_url(retriever) else None,
                             index_dir=Path(retriever) if retriever and not is_url(retriever) else None,
                             bucket=None if retriever else bucket, run_id=run_id, fingerprint=fingerprint,
                             note=note)
    return task.make_tools(searcher)
