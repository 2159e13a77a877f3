"""Run files both sides use: the contract and the model's config/tokenizer files kept in the bucket."""

from __future__ import annotations

import time
from pathlib import Path

from stoa.bucket import Bucket, ObjectExists, ObjectNotFound
from stoa.records import ContractMismatch, RunContract, contract_key, run_prefix

MODEL_FILE_SUFFIXES = (".json", ".jinja", ".txt", ".model")
"""Non-weight files of a model directory that workers download from the bucket."""


def upload_model_files(bucket: Bucket, run_id: str, model_dir: Path) -> list[str]:
    """Upload config and tokenizer files (not weights) so workers need nothing but the bucket.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        model_dir: the base model directory.
    """
    keys = []
    for f in sorted(Path(model_dir).iterdir()):
        if f.is_file() and f.suffix in MODEL_FILE_SUFFIXES:
            key = f"{run_prefix(run_id)}/model/{f.name}"
            try:
                bucket.put_create(key, f.read_bytes())
            except ObjectExists as e:
                raise ContractMismatch(["model"], f"{key} exists with other content") from e
            keys.append(key)
    return keys


def _model_names(bucket: Bucket, prefix: str) -> list[str]:
    """File names directly under the model prefix (no sub-keys, no dot files)."""
    names = []
    for info in bucket.list(prefix):
        name = info.key[len(prefix):]
        if name and "/" not in name and not name.startswith("."):
            names.append(name)
    return names


def model_files_ready(names: list[str]) -> bool:
    """Whether a model file listing is usable: ``config.json`` and ``tokenizer.json`` (fast tokenizers only).

    Args:
        names: file names under ``runs/<run>/model/``.
    """
    return "config.json" in names and "tokenizer.json" in names


def download_model_files(bucket: Bucket, run_id: str, dest: Path, timeout_s: float = 0.0, poll_s: float = 1.0,
                         echo=print) -> Path:
    """Fetch the run's config and tokenizer files into ``dest`` (used by workers and tools).

    Waits up to ``timeout_s`` for them to appear (``config.json`` and ``tokenizer.json``): a worker may
    see the contract of a trainer that is still starting, so it waits for the model files like it
    waits for the contract, with one note line.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        dest: local directory to fill.
        timeout_s: how long to wait for the files (0: look once).
        poll_s: wait between looks.
        echo: where the waiting note goes.

    Raises:
        ObjectNotFound: no usable model files after ``timeout_s``; names the prefix and the fix.
    """
    prefix = f"{run_prefix(run_id)}/model/"
    deadline = time.monotonic() + timeout_s
    noted = False
    while not model_files_ready(names := _model_names(bucket, prefix)):
        if time.monotonic() >= deadline:
            raise ObjectNotFound(f"run {run_id!r} has no model files (config.json and tokenizer.json) under {prefix} "
                                 f"after {timeout_s:.0f}s; start the trainer, or pass --model DIR")
        if not noted:
            echo(f"[worker] waiting for the model files of run {run_id!r} under {prefix}")
            noted = True
        time.sleep(poll_s)
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        (dest / name).write_bytes(bucket.get(prefix + name))
    return dest


def wait_for_contract(bucket: Bucket, run_id: str, timeout_s: float, poll_s: float = 1.0, echo=print) -> RunContract:
    """Read the run contract, waiting up to ``timeout_s`` for a trainer to write it.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        timeout_s: how long to wait.
        poll_s: wait between attempts.
        echo: where the waiting note goes.
    """
    deadline = time.monotonic() + timeout_s
    noted = False
    while True:
        try:
            return RunContract.from_json(bucket.get(contract_key(run_id)))
        except ObjectNotFound:
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {run_id!r} has no contract in {bucket.url} after {timeout_s:.0f}s; "
                                   "start the trainer first or check --run/--bucket") from None
            if not noted:
                echo(f"[worker] waiting for run {run_id!r} to appear in {bucket.url}")
                noted = True
            time.sleep(poll_s)
