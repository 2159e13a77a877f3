"""Task data through the bucket: the files a task's options name travel like the model files do.

A task class lists the options that name local files in ``FILE_OPTIONS`` (GSM8K: ``path``, ``test_path``;
searchqa: ``path``, ``test_path``, ``corpus``). The trainer uploads each such file, create-only and
content-addressed, to ``runs/<run>/data/<sha256>/<name>`` before it writes the contract, and the contract's
``task_spec`` carries the portable reference ``bucket:<sha256>/<name>`` instead of the trainer's local path,
so the contract (and its fingerprint) is the same on every machine. A worker, the evaluator or a restarted
trainer turns the references back into local files with :func:`localize_options`: each file is downloaded
once into a content-addressed cache, its SHA-256 checked (a mismatch is refused, the file never used), and
the option rewritten to the local path before ``get_task``. Tasks without file options are untouched.

A contract is untrusted (any bucket writer may have written it): workers and evaluators use
:func:`localize_contract_options`, which accepts a file option only as a ``bucket:`` reference and refuses a
local, absolute or home path, ``..``, a URL or a malformed reference (``TaskDataRefused``, exit 3) before
anything is opened. :func:`localize_options` passes such values through: it is the trainer's, whose ``--task``
names the user's own files.

Keys come from ``stoa.layout``. This module imports neither torch nor mlx.
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoa.bucket import Bucket, ObjectExists, ObjectNotFound
from stoa.contract import ContractMismatch
from stoa.layout import task_data_key
from stoa.models.registry import default_cache_dir
from stoa.tasks import ADAPTERS, TASKS, TaskPluginError, task_class

__all__ = [
    "REF_PREFIX",
    "DataRef",
    "TaskData",
    "TaskDataMismatch",
    "TaskDataRefused",
    "TaskFile",
    "file_options",
    "file_sha256",
    "localize_contract_options",
    "localize_options",
    "parse_ref",
    "portable_task_data",
    "task_data_cache",
    "upload_task_files",
]

REF_PREFIX = "bucket:"
"""How a contract's task option names a file in the bucket: ``bucket:<sha256>/<name>``."""

_REF = re.compile(r"bucket:(?P<digest>[0-9a-f]{64})/(?P<name>[A-Za-z0-9_-][A-Za-z0-9._-]{0,127})")
_CHUNK = 1 << 20
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")


class TaskDataMismatch(ContractMismatch):
    """A task data file disagrees with the run contract (wrong digest, or another object at its key).

    Args:
        option: the task option the file belongs to.
        detail: what differs and the fix.
    """

    def __init__(self, option: str, detail: str):
        super().__init__([f"task_spec.{option}"], detail)


class TaskDataRefused(TaskDataMismatch):
    """A run contract names task data by something other than its content address in the bucket (a local,
    absolute or home path, ``..``, a URL, a malformed ``bucket:`` reference); nothing it names is opened.

    Args:
        option: the task option.
        detail: what the value names and the fix.
    """


@dataclass(frozen=True)
class DataRef:
    """A parsed ``bucket:<sha256>/<name>`` reference."""

    digest: str
    """The file's SHA-256 (64 lowercase hex digits)."""
    name: str
    """The file's name (kept so suffixes such as ``.parquet`` still choose the reader)."""

    @property
    def ref(self) -> str:
        """The reference string as the contract stores it."""
        return f"{REF_PREFIX}{self.digest}/{self.name}"


@dataclass(frozen=True)
class TaskFile:
    """One local file a task option names, with its content digest."""

    option: str
    """The task option (``path``, ``test_path``, ``corpus``)."""
    path: Path
    """The local file."""
    data: DataRef
    """Its digest and bucket name."""


@dataclass(frozen=True)
class TaskData:
    """A task's portable spec and the files it references."""

    spec: dict[str, object]
    """``task.spec()`` with every file option replaced by its ``bucket:`` reference."""
    files: tuple[TaskFile, ...]
    """The local files to upload before the contract is written."""


def file_options(task_id: str) -> tuple[str, ...]:
    """The options of a registered task that name local files (``()`` for an unknown task or none).

    Args:
        task_id: a task name (``gsm8k``).
    """

    return tuple(getattr(_task_cls(task_id), "FILE_OPTIONS", ()))


def _task_cls(task_id: str) -> type | None:
    """A built-in task's class, or an adapter's (stoa's own, imported when named: ``dataset``); else None."""
    if task_id in ADAPTERS:
        try:
            return task_class(task_id)
        except TaskPluginError:  # an adapter whose optional package is absent: the task itself will say so
            return None
    return TASKS.get(task_id)


def _hub_options(task_id: str) -> tuple[str, ...]:
    """The options of a registered task that name a hub dataset (``HUB_OPTIONS``; ``()`` for none)."""

    return tuple(getattr(_task_cls(task_id), "HUB_OPTIONS", ()))


def parse_ref(value: object) -> DataRef | None:
    """The reference in an option value, or ``None`` when it is not ``bucket:<sha256>/<name>``.

    Args:
        value: an option value (any type; untrusted).
    """
    m = _REF.fullmatch(value) if isinstance(value, str) else None
    return DataRef(m.group("digest"), m.group("name")) if m else None


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, read in chunks.

    Args:
        path: the file.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _bucket_name(path: Path) -> str:
    """A key-safe version of a file's name that keeps its suffix."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", path.name)[-128:].lstrip(".")
    return name or "data"


def portable_task_data(task: Any) -> TaskData:
    """``task.spec()`` with each file option's local path replaced by a ``bucket:`` reference (nothing uploaded).

    Args:
        task: a built task (``id``, ``spec()``).
    """
    spec = dict(task.spec())
    files: list[TaskFile] = []
    for option in file_options(task.id):
        value = spec.get(option)
        if not isinstance(value, str) or parse_ref(value) is not None:
            continue
        path = Path(value)
        ref = DataRef(file_sha256(path), _bucket_name(path))
        files.append(TaskFile(option, path, ref))
        spec[option] = ref.ref
    return TaskData(spec, tuple(files))


def upload_task_files(bucket: Bucket, run_id: str, files: Sequence[TaskFile]) -> list[str]:
    """Upload the task's files create-only under ``runs/<run>/data/`` (an identical object is success).

    Args:
        bucket: the run's bucket.
        run_id: the run.
        files: from :func:`portable_task_data`.

    Raises:
        TaskDataMismatch: another object already holds a file's key (a tampered bucket); delete it.
    """
    keys = []
    for f in files:
        key = task_data_key(run_id, f.data.digest, f.data.name)
        try:
            bucket.put_file(key, f.path, create_only=True)
        except ObjectExists:
            raise TaskDataMismatch(f.option, f"{key} holds other bytes than {f.path}; delete that object and "
                                             "start the trainer again") from None
        keys.append(key)
    return keys


def task_data_cache() -> Path:
    """Where downloaded task files are kept: ``$STOA_CACHE/task-data`` (default ``~/.cache/stoa/task-data``)."""

    return default_cache_dir() / "task-data"


def _fetch(bucket: Bucket, run_id: str, option: str, ref: DataRef, cache_dir: Path) -> Path:
    """The verified local copy of one referenced file, downloaded when the cache lacks a good copy."""
    dest = cache_dir / ref.digest / ref.name
    if dest.is_file() and file_sha256(dest) == ref.digest:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    key = task_data_key(run_id, ref.digest, ref.name)
    part = dest.with_name(f".{ref.name}.{uuid.uuid4().hex[:12]}.part")
    try:
        bucket.get_file(key, part)
        got = file_sha256(part)
        if got != ref.digest:
            raise TaskDataMismatch(option, f"{key} has SHA-256 {got[:16]}…, the contract says {ref.digest[:16]}…; "
                                           "the bucket's copy was altered: restore it or start a new run")
        os.replace(part, dest)
    except ObjectNotFound:
        raise TaskDataMismatch(option, f"run {run_id!r} has no task data object {key}; start its trainer, "
                                       "which uploads it") from None
    finally:
        part.unlink(missing_ok=True)
    return dest


def localize_options(bucket: Bucket, run_id: str, task_id: str, options: Mapping[str, object],
                     cache_dir: Path | None = None) -> dict[str, object]:
    """Task options with every ``bucket:`` file reference replaced by a verified local copy's path.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        task_id: the task (its ``FILE_OPTIONS`` are the options looked at).
        options: the contract's ``task_spec`` (or a parsed ``--task``); other values pass through.
        cache_dir: where copies live, one folder per digest (default :func:`task_data_cache`).

    Raises:
        TaskDataMismatch: a file is missing from the bucket or does not match its digest (never used).
    """
    out = dict(options)
    for option in file_options(task_id):
        ref = parse_ref(out.get(option))
        if ref is not None:
            out[option] = str(_fetch(bucket, run_id, option, ref, cache_dir or task_data_cache()))
    return out


def _not_a_reference(value: object) -> str:
    """What a file option value that is not a ``bucket:`` reference names, for the refusal line."""
    if not isinstance(value, str):
        return f"a {type(value).__name__}, not a bucket: reference"
    shown = repr(value[:120]) + ("…" if len(value) > 120 else "")
    if value.startswith(REF_PREFIX):
        return f"the malformed reference {shown} (not bucket:<64 hex digits>/<plain file name>)"
    if value.startswith("~"):
        return f"the home path {shown}"
    if value.startswith(("/", "\\")) or re.match(r"[A-Za-z]:[\\/]", value):
        return f"the absolute path {shown}"
    if "://" in value or re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", value):
        return f"the URL {shown}"
    if ".." in re.split(r"[\\/]", value):
        return f"the path {shown}, which climbs out with '..'"
    return f"the local path {shown}"


def contract_refs(task_id: str, task_spec: Mapping[str, object]) -> dict[str, DataRef]:
    """The ``bucket:`` reference of every file option a run contract's task spec sets, checked before any is used.

    A worker or an evaluator reads task data only by content address in the run's bucket: a value that is not
    ``bucket:<sha256>/<name>`` (a local, absolute or home path, ``..``, a URL, anything malformed) is refused,
    so a contract can never make a machine open its own files. A hub dataset option (``HUB_OPTIONS``: gsm8k's
    ``hf``) must be a hub id (``owner/name``), never a path ``datasets`` would read locally.

    Args:
        task_id: the contract's task.
        task_spec: the contract's task options (untrusted).

    Raises:
        TaskDataRefused: a file option that is not a ``bucket:`` reference, or a hub option that is not a hub id
            (the first one, named).
    """
    for option in _hub_options(task_id):
        value = task_spec.get(option)
        if value is not None and not (isinstance(value, str) and _HUB_ID.fullmatch(value) and ".." not in value):
            raise TaskDataRefused(option, f"the run contract names {_not_a_reference(value)} as a hub dataset; "
                                          "workers and evaluators accept only a hub id (owner/name) there, nothing "
                                          "was opened")
    refs: dict[str, DataRef] = {}
    for option in file_options(task_id):
        value = task_spec.get(option)
        if value is None:
            continue
        ref = parse_ref(value)
        if ref is None:
            raise TaskDataRefused(option, f"the run contract names {_not_a_reference(value)}; workers and "
                                          "evaluators read task data only as bucket:<sha256>/<name> from the run's "
                                          "bucket, nothing was opened; restart the run's trainer, which uploads "
                                          "its files and names them so")
        refs[option] = ref
    return refs


def localize_contract_options(bucket: Bucket, run_id: str, task_id: str, task_spec: Mapping[str, object],
                              cache_dir: Path | None = None) -> dict[str, object]:
    """A run contract's task options with every file option replaced by a verified local copy from the bucket.

    The strict form of :func:`localize_options` for machines that follow a run (workers, evaluators): every
    file option must be a ``bucket:`` reference (:func:`contract_refs`, checked for all options before anything
    is fetched), and each copy's SHA-256 must equal its reference's.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        task_id: the contract's task.
        task_spec: the contract's task options (untrusted).
        cache_dir: where copies live (default :func:`task_data_cache`).

    Raises:
        TaskDataRefused: a file option that is not a ``bucket:`` reference.
        TaskDataMismatch: a referenced file is missing from the bucket or does not match its digest.
    """
    out = dict(task_spec)
    for option, ref in contract_refs(task_id, task_spec).items():
        out[option] = str(_fetch(bucket, run_id, option, ref, cache_dir or task_data_cache()))
    return out
