"""Metrics as JSONL lines (``train/*``, ``rollout/*``, ``worker/*``, ``eval/*``), plus W&B when installed."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Append one JSON object per ``log`` call to ``path``; mirror to W&B if ``WANDB_PROJECT`` is set.

    Args:
        path: the JSONL file (parent directories are created).
        run_name: name for the optional W&B run.
    """

    def __init__(self, path: str | Path, run_name: str = "stoa"):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        self._wandb = None
        if os.environ.get("WANDB_PROJECT"):
            try:
                import wandb  # pyright: ignore[reportMissingImports]  # optional, imported only if present

                self._wandb = wandb.init(project=os.environ["WANDB_PROJECT"], name=run_name, resume="allow")
            except ImportError:
                pass

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Write one line; non-finite floats become null.

        Args:
            metrics: flat name -> number/str.
            step: optional step counter stored as ``step``.
        """
        row: dict[str, Any] = {"time": round(time.time(), 3)}
        if step is not None:
            row["step"] = step
        for k, v in metrics.items():
            if isinstance(v, float) and not math.isfinite(v):
                v = None
            row[k] = v
        self._fh.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if isinstance(v, int | float)}, step=step)

    def close(self) -> None:
        """Flush and close."""
        self._fh.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read every row of a metrics JSONL file (skipping a torn last line).

    Args:
        path: the JSONL file.
    """
    rows = []
    p = Path(path)
    if not p.exists():
        return rows
    for line in p.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def default_log_dir(bucket_url: str, run_id: str, explicit: str = "") -> Path:
    """Where metrics go: the explicit dir, else inside a local bucket, else ./stoa-logs/<run>.

    Args:
        bucket_url: the bucket URL.
        run_id: the run.
        explicit: a user-given directory (wins when set).
    """
    if explicit:
        return Path(explicit)
    if "://" not in bucket_url or bucket_url.startswith("file://"):
        root = bucket_url[len("file://"):] if bucket_url.startswith("file://") else bucket_url
        from stoa.layout import metrics_prefix

        return Path(root) / metrics_prefix(run_id)
    return Path("stoa-logs") / run_id
