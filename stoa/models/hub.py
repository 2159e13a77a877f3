"""Hugging Face Hub downloads that say how far they got.

The CLI switches the hub's own progress bars off (``HF_HUB_DISABLE_PROGRESS_BARS``: they garble logs), so a model
download would otherwise print nothing for minutes. :func:`hub_snapshot` prints one line before, a progress line
every few seconds while bytes arrive (:class:`ProgressLines`, a plain tqdm class the hub accepts as
``tqdm_class``, so the hub's switch does not silence it), and one line when the files are in.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tqdm import tqdm

PROGRESS_EVERY_S = 5.0
"""Seconds between two progress lines of one download bar."""


class ProgressLines(tqdm):
    """A tqdm bar that writes whole lines (``[model] Downloading: 120 MB / 270 MB (44%), 12.0 MB/s``) to stderr
    at most every :data:`PROGRESS_EVERY_S`, whatever the hub's own progress-bar switch says."""

    def __init__(self, *args: Any, name: str | None = None, **kwargs: Any) -> None:  # noqa: ARG002 - the hub's
        kwargs.update(disable=False, mininterval=PROGRESS_EVERY_S, file=kwargs.get("file") or sys.stderr)
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:  # noqa: ARG002 - tqdm's signature
        """Write the bar's state as one line (tqdm calls this on refresh, every ``mininterval`` and at close)."""
        if self.fp is not None:
            self.fp.write(progress_line(self.format_dict) + "\n")
            self.fp.flush()
        return True


def progress_line(d: Mapping[str, Any]) -> str:
    """One progress line from a tqdm ``format_dict``: what, how much of how much, the rate.

    Args:
        d: ``tqdm.format_dict`` (``desc``, ``n``, ``total``, ``unit``, ``unit_scale``, ``rate``).
    """
    unit, scaled = d.get("unit") or "it", bool(d.get("unit_scale"))

    def amount(x: float) -> str:
        return f"{tqdm.format_sizeof(x)}{unit}" if scaled else f"{x:g} {unit}"

    n, total, rate = d.get("n") or 0, d.get("total"), d.get("rate")
    text = amount(n) + (f" / {amount(total)} ({100 * n / total:.0f}%)" if total else "")
    if rate:
        text += f", {amount(rate)}/s"
    return f"[model] {(d.get('prefix') or 'download').rstrip(': ')}: {text}"


def hub_snapshot(repo_id: str, patterns: list[str], *, download: Callable[..., str] | None = None,
                 echo: Callable[[str], Any] = print) -> Path:
    """Download a hub repository's files matching ``patterns`` (or find them cached), with progress lines.

    Args:
        repo_id: ``ORG/NAME``.
        patterns: the files to fetch (``allow_patterns``).
        download: ``huggingface_hub.snapshot_download`` or a stand-in with its keywords (tests).
        echo: where the first and last lines go.

    Returns:
        the snapshot directory.
    """
    fetch = download if download is not None else _snapshot_download()
    echo(f"[model] {repo_id}: fetching from the Hugging Face Hub (or its cache) ...")
    t0 = time.monotonic()
    path = Path(fetch(repo_id=repo_id, allow_patterns=patterns, tqdm_class=ProgressLines))
    files = [f for f in path.rglob("*") if f.is_file()]
    size = sum(f.stat().st_size for f in files)
    echo(f"[model] {repo_id}: {len(files)} files, {tqdm.format_sizeof(size)}B in {path} "
         f"({time.monotonic() - t0:.1f}s)")
    return path


def _snapshot_download() -> Callable[..., str]:
    from huggingface_hub import snapshot_download

    return snapshot_download
