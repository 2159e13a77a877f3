"""The rows of a dataset task's files: jsonl or parquet, read with bounds (a worker gets them from the bucket).

A file is a table: one JSON object per jsonl line (blank lines skipped), or one parquet row (``pyarrow``, the
``stoa[data]`` extra, imported only for parquet). A directory holds ``train.jsonl`` (or ``train.parquet``) and
optionally ``test.jsonl`` (or ``test.parquet``). A ``datasets.save_to_disk`` directory is refused with the
one-line export that turns it into a parquet file: the trainer ships task files through the bucket one file
each, and the ``datasets`` package is not needed to read either format. A Hugging Face hub dataset
(:func:`hub_tables`) needs ``datasets`` (the ``stoa[datasets]`` extra) and the network on every machine.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoa.tasks.base import TaskDataError, TaskOptionError
from stoa.untrusted import loads_bounded

__all__ = ["MAX_LINE_BYTES", "MAX_ROWS", "SUFFIXES", "DataFiles", "Table", "fingerprint", "hub_tables", "jsonl_rows",
           "parquet_rows", "read_table", "resolve_files"]

MAX_LINE_BYTES = 16 << 20
"""Longest jsonl line read."""
MAX_LINE_DEPTH = 16
"""Deepest JSON nesting of a row (a conversational prompt is 3 deep)."""
MAX_ROWS = 5_000_000
"""Most rows one file may hold."""
SUFFIXES = (".jsonl", ".parquet")
"""The file formats read, by name suffix."""


@dataclass(frozen=True)
class Table:
    """A file's rows, each a dict of column -> value, and the columns in first-seen order."""

    rows: list[dict[str, Any]]
    """The rows in file order."""
    columns: tuple[str, ...]
    """Every column any row has."""
    source: str
    """The file, for messages."""


@dataclass(frozen=True)
class DataFiles:
    """The train file and the test file (None: no explicit test split) an option pair resolves to."""

    train: Path
    """The train split's file."""
    test: Path | None
    """The test split's file, or None."""


def _format_of(path: Path, option: str) -> str:
    if path.suffix not in SUFFIXES:
        raise TaskOptionError(f"dataset: option {option!r}: {path} is not a {' or '.join(SUFFIXES)} file; "
                              "convert it (pandas: df.to_json(path, orient='records', lines=True))")
    return path.suffix


def _in_dir(folder: Path, stem: str) -> Path | None:
    found = [folder / f"{stem}{s}" for s in SUFFIXES if (folder / f"{stem}{s}").is_file()]
    return found[0] if found else None


def resolve_files(path: str, test_path: str | None) -> DataFiles:
    """The files the ``path`` and ``test_path`` options name (a directory's ``train.*``/``test.*``).

    Args:
        path: a jsonl or parquet file, or a directory holding ``train.jsonl``/``train.parquet``.
        test_path: an explicit test file, or None (then ``test.*`` beside a directory's train file).

    Raises:
        TaskOptionError: a missing file, an unknown format, or a ``save_to_disk`` directory (with the fix).
    """
    p = Path(path).expanduser().resolve()
    test: Path | None = None
    if p.is_dir():
        if (p / "dataset_dict.json").is_file() or (p / "state.json").is_file():
            raise TaskOptionError(f"dataset: option 'path': {p} is a datasets.save_to_disk directory; export each "
                                  "split to one file: datasets.load_from_disk(dir)['train'].to_parquet("
                                  "'train.parquet') (and 'test'), then give path=that file or its folder")
        train = _in_dir(p, "train")
        if train is None:
            raise TaskOptionError(f"dataset: option 'path': {p} holds no train.jsonl or train.parquet; give a "
                                  "jsonl or parquet file, or a directory holding train.jsonl (and test.jsonl)")
        test = _in_dir(p, "test")
        p = train
    elif not p.is_file():
        raise TaskOptionError(f"dataset: option 'path': no such file: {p}; give a jsonl or parquet file, or a "
                              "directory holding train.jsonl (and test.jsonl)")
    _format_of(p, "path")
    if test_path is not None:
        test = Path(test_path).expanduser().resolve()
        if not test.is_file():
            raise TaskOptionError(f"dataset: option 'test_path': no such file: {test}; give a jsonl or parquet "
                                  "file")
        _format_of(test, "test_path")
    return DataFiles(p, test)


def jsonl_rows(path: Path, who: str = "dataset", max_bytes: int = MAX_LINE_BYTES,
               max_depth: int = MAX_LINE_DEPTH) -> Iterator[tuple[str, Any]]:
    """(``file:line``, parsed JSON) of each non-blank line, each bounded (``stoa.untrusted``).

    Args:
        path: the jsonl file.
        who: the task, for messages.
        max_bytes: the longest line read.
        max_depth: the deepest nesting read.

    Raises:
        TaskOptionError: a line that is not valid JSON within the bounds, named by file and line.
    """
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", loads_bounded(line, max_bytes=max_bytes, max_depth=max_depth)
            except ValueError as e:  # also too deep, a number too long, NaN or invalid UTF-8
                raise TaskOptionError(f"{who}: {path}:{lineno}: not valid JSON ({str(e)[:200]}); fix or drop "
                                      "that line") from None


def parquet_rows(path: Path, who: str = "dataset") -> Iterator[tuple[str, Any]]:
    """(``file:row i``, row) of a parquet file, its row count bounded; a damaged file is one line.

    Args:
        path: the parquet file.
        who: the task, for messages.

    Raises:
        TaskDataError: pyarrow is not installed.
        TaskOptionError: too many rows, or a file pyarrow cannot read.
    """
    try:
        pq = importlib.import_module("pyarrow.parquet")
    except ImportError:
        raise TaskDataError(f"{who}: reading {path} needs pyarrow (pip install 'stoa[data]'), or convert it to "
                            "jsonl") from None
    try:
        f = pq.ParquetFile(path)
        if f.metadata.num_rows > MAX_ROWS:
            raise TaskOptionError(f"{who}: {path} has {f.metadata.num_rows} rows, more than {MAX_ROWS}; "
                                  "split it")
        rows = f.read().to_pylist()
    except TaskOptionError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow raises many kinds on a damaged file
        raise TaskOptionError(f"{who}: {path} is not a readable parquet file ({type(e).__name__}: "
                              f"{str(e)[:200]}); write it again (df.to_parquet)") from None
    for i, row in enumerate(rows):
        yield f"{path}:row {i}", row


def read_table(path: Path) -> Table:
    """The rows of a jsonl or parquet file, each a JSON object.

    Args:
        path: the file (its suffix picks the reader).

    Raises:
        TaskOptionError: a line that is not a JSON object (named by line), too many rows, a damaged parquet file.
        TaskDataError: a parquet file without pyarrow installed.
    """
    reader = parquet_rows if path.suffix == ".parquet" else jsonl_rows
    rows: list[dict[str, Any]] = []
    columns: dict[str, None] = {}
    for where, row in reader(path):
        if not isinstance(row, dict):
            raise TaskOptionError(f"dataset: {where}: expected a JSON object (one row), got {type(row).__name__}")
        if len(rows) >= MAX_ROWS:
            raise TaskOptionError(f"dataset: {path} has more than {MAX_ROWS} rows; split it")
        columns.update(dict.fromkeys(row))
        rows.append(row)
    return Table(rows, tuple(columns), str(path))


def fingerprint(rows: Iterable[dict[str, Any]]) -> str:
    """SHA-256 over the rows in order, keys sorted (values that are not JSON, such as parquet dates, by ``str``).

    Args:
        rows: the split's rows.
    """
    h = hashlib.sha256()
    for row in rows:
        h.update(json.dumps(row, ensure_ascii=False, sort_keys=True, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()


def _split_table(splits: Any, name: str, where: str) -> Table:
    split = splits[name]
    if len(split) > MAX_ROWS:
        raise TaskOptionError(f"dataset: {where} has {len(split)} {name} rows, more than {MAX_ROWS}")
    rows = [dict(r) for r in split]
    columns: dict[str, None] = {}
    for r in rows:
        columns.update(dict.fromkeys(r))
    return Table(rows, tuple(columns), f"{where}[{name}]")


def hub_tables(dataset: str, config: str) -> tuple[Table, Table | None]:
    """The train split and the test split (None when the dataset has none) of a hub dataset, via ``datasets``.

    Args:
        dataset: the hub id, ``owner/name``.
        config: the dataset's config name, "" for its default.

    Raises:
        TaskDataError: ``datasets`` is not installed, or the load failed (no network); the message names a local
            file instead.
        TaskOptionError: the dataset has no train split.
    """
    local = "or save it as jsonl where the network reaches (ds.to_json('train.jsonl')) and give path=train.jsonl"
    try:
        datasets = importlib.import_module("datasets")
    except ImportError:
        raise TaskDataError(f"dataset: hf={dataset} needs the 'datasets' package (pip install 'stoa[datasets]'), "
                            f"{local}") from None
    try:
        splits = datasets.load_dataset(dataset, config or None)
    except Exception as e:  # noqa: BLE001 - the hub raises many kinds (connection, auth, missing config)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise TaskDataError(f"dataset: could not load {dataset!r} from the hub ({first}); {local}") from None
    where = f"hf:{dataset}" + (f"/{config}" if config else "")
    if "train" not in splits:
        raise TaskOptionError(f"dataset: {where} has no 'train' split (its splits: {sorted(splits)}); give a local "
                              "file with path=FILE")
    test = _split_table(splits, "test", where) if "test" in splits else None
    return _split_table(splits, "train", where), test
