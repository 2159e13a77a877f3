"""Helpers for the dataset task's tests: jsonl files and reward modules written to a temporary directory."""

from __future__ import annotations

import json
import textwrap
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest


def write_jsonl(path: Path, rows: Sequence[Mapping[str, object]]) -> Path:
    """``rows`` as a jsonl file (parents made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def reward_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> str:
    """A loose module with ``source`` in ``tmp_path`` (the working directory), under a fresh name; its name."""
    name = f"rw_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))  # saves sys.path, so the test's additions are undone
    monkeypatch.chdir(tmp_path)
    return name


ADDITIONS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b), "level": a % 3}
             for a in range(10, 40) for b in (11, 57)]
"""60 plain-text rows with an extra column."""
