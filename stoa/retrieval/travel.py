"""Moving an index through the run's bucket, and opening the searcher a machine should use.

``upload_index`` writes every file of an index directory create-only under
``runs/<run>/retriever/<fingerprint>/`` (keys from ``stoa.layout``), the manifest ``stoa-index.json`` last, so
a reader that sees the manifest can read every file. ``download_index`` fetches into a temporary sibling
directory, checks every file's size and digest against the manifest and recomputes the fingerprint from the
documents, and only then renames the directory into place: a partial or altered download is refused and
never loaded. No torch, no mlx.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stoa.bucket.base import Bucket, ObjectNotFound
from stoa.layout import retriever_file_key, retriever_prefix
from stoa.models.registry import default_cache_dir
from stoa.retrieval.base import Searcher
from stoa.retrieval.bm25 import INDEX_MANIFEST, BadIndex, BM25Index, read_manifest, verify_index_dir
from stoa.retrieval.client import HTTPSearcher, RetrieverMismatch
from stoa.schemas.index import MAX_MANIFEST_BYTES, IndexManifest

__all__ = ["default_index_cache", "download_index", "open_searcher", "upload_index"]

_FINGERPRINT = re.compile(r"[0-9a-f]{32}")
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _check_fingerprint(fingerprint: str) -> str:
    if not isinstance(fingerprint, str) or not _FINGERPRINT.fullmatch(fingerprint):
        raise BadIndex(f"fingerprint {str(fingerprint)[:80]!r}: must be 32 lowercase hex digits (stoa retriever "
                       "index prints it)")
    return fingerprint


def _file_names(manifest: IndexManifest, where: str) -> list[str]:
    names = sorted(manifest.files)
    bad = [n for n in names if not isinstance(n, str) or not _FILE_NAME.fullmatch(n) or n == INDEX_MANIFEST]
    if bad:
        raise BadIndex(f"{where}: file names {bad} are not plain file names; the manifest is damaged")
    return names


def upload_index(bucket: Bucket, run_id: str, index_dir: str | Path) -> str:
    """Upload a saved index under the run (create-only, manifest last); a complete copy already there is kept.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        index_dir: a directory written by ``BM25Index.save`` (checked against its manifest first).

    Returns:
        The index's fingerprint (what the contract names).

    Raises:
        BadIndex: the directory is incomplete or damaged.
        stoa.bucket.ObjectExists: a different object already sits at one of the keys.
    """
    root = Path(index_dir)
    fingerprint = _check_fingerprint(verify_index_dir(root))
    manifest_key = retriever_file_key(run_id, fingerprint, INDEX_MANIFEST)
    if bucket.exists(manifest_key):
        return fingerprint
    for name in _file_names(read_manifest(root), str(root / INDEX_MANIFEST)):
        bucket.put_file(retriever_file_key(run_id, fingerprint, name), root / name, create_only=True)
    bucket.put_create(manifest_key, (root / INDEX_MANIFEST).read_bytes())
    return fingerprint


def _usable(dest: Path, fingerprint: str) -> bool:
    """Whether ``dest`` already holds the complete index ``fingerprint`` (manifest and file sizes agree)."""
    try:
        manifest = read_manifest(dest)
    except BadIndex:
        return False
    return manifest.fingerprint == fingerprint and all(
        (dest / n).is_file() and (dest / n).stat().st_size == meta.size for n, meta in manifest.files.items())


def download_index(bucket: Bucket, run_id: str, fingerprint: str, dest: str | Path,
                   note: Callable[[str], Any] = print) -> Path:
    """Fetch the run's index ``fingerprint`` into ``dest`` (reused when already there), verified before use.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        fingerprint: the index (the contract's ``retriever.fingerprint``).
        dest: the index directory to create (its parent must be writable).
        note: where the progress line goes.

    Raises:
        ObjectNotFound: the bucket has no complete index ``fingerprint`` for the run.
        BadIndex: the downloaded files do not match their manifest or fingerprint (nothing is kept), or
            ``dest`` holds something else.
    """
    _check_fingerprint(fingerprint)
    dest = Path(dest)
    if _usable(dest, fingerprint):
        return dest
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise BadIndex(f"{dest} exists and is not index {fingerprint}; remove it or choose another directory")
    try:
        manifest_bytes = bucket.get_range(retriever_file_key(run_id, fingerprint, INDEX_MANIFEST), 0,
                                          MAX_MANIFEST_BYTES + 1)  # a larger one is refused unread
    except ObjectNotFound:
        raise ObjectNotFound(f"run {run_id!r} has no complete retriever index under "
                             f"{retriever_prefix(run_id, fingerprint)}; upload it (stoa retriever upload)") from None
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        (tmp / INDEX_MANIFEST).write_bytes(manifest_bytes)
        manifest = read_manifest(tmp)
        if manifest.fingerprint != fingerprint:
            raise BadIndex(f"{retriever_prefix(run_id, fingerprint)}{INDEX_MANIFEST} names index "
                           f"{manifest.fingerprint}; the bucket copy is damaged")
        note(f"[retriever] downloading index {fingerprint} ({manifest.docs} documents) to {dest}")
        for name in _file_names(manifest, INDEX_MANIFEST):
            bucket.get_file(retriever_file_key(run_id, fingerprint, name), tmp / name)
        verify_index_dir(tmp)
        _move_into_place(tmp, dest, fingerprint)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _move_into_place(tmp: Path, dest: Path, fingerprint: str) -> None:
    """Rename the verified ``tmp`` to ``dest``; a concurrent download that got there first wins."""
    if dest.is_dir() and not any(dest.iterdir()):
        dest.rmdir()
    try:
        os.replace(tmp, dest)
    except OSError:
        if not _usable(dest, fingerprint):
            raise


def default_index_cache() -> Path:
    """Where downloaded indexes live: ``$STOA_CACHE/retriever`` (default ``~/.cache/stoa/retriever``)."""

    return default_cache_dir() / "retriever"


def open_searcher(*, url: str | None = None, index_dir: str | Path | None = None, bucket: Bucket | None = None,
                  run_id: str | None = None, fingerprint: str | None = None, cache_dir: str | Path | None = None,
                  note: Callable[[str], Any] = print, retry_seconds: float = 60.0) -> Searcher:
    """The searcher of this machine: a shared endpoint, a local index directory, or the run's index.

    Args:
        url: an endpoint (``stoa retriever serve``); wins over everything else.
        index_dir: a local index directory (memory-mapped).
        bucket: the run's bucket, with ``run_id`` and ``fingerprint``: download the index (cached) and load it.
        run_id: the run.
        fingerprint: the corpus the run searches; an endpoint or directory serving another one is refused.
        cache_dir: where downloads go (default ``default_index_cache()``).
        note: where waiting and download messages go.
        retry_seconds: how long an endpoint is retried before ``ToolUnavailable``.

    Raises:
        RetrieverMismatch: the directory holds another index than ``fingerprint``.
        ValueError: none of the three ways was given (names them).
    """
    if url:
        return HTTPSearcher(url, fingerprint=fingerprint, retry_seconds=retry_seconds, note=note)
    if index_dir is not None:
        index = BM25Index.load(index_dir, mmap=True)
        if fingerprint and index.fingerprint != fingerprint:
            raise RetrieverMismatch(str(index_dir), fingerprint, index.fingerprint)
        return index
    if bucket is not None and run_id and fingerprint:
        cache = Path(cache_dir) if cache_dir is not None else default_index_cache()
        dest = cache / _check_fingerprint(fingerprint)  # the contract's (untrusted): 32 hex digits or refused
        return BM25Index.load(download_index(bucket, run_id, fingerprint, dest, note=note), mmap=True)
    raise ValueError("retriever: give an endpoint URL, an index directory, or a bucket with the run id and the "
                     "index fingerprint")
