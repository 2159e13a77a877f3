"""Fixtures of the hostile-bucket suite: the base runs (built once per session) and a working directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.hostile.matrix import Bases


@pytest.fixture(scope="session")
def hostile_work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Cell sandboxes and the kept 64 MiB bodies (one per object type and variant, hard-linked into cells)."""
    return tmp_path_factory.mktemp("hostile")


@pytest.fixture(scope="session")
def hostile_bases(hostile_work: Path) -> Bases:
    """The base runs, each built on first use, on a model cache of their own."""
    from stoa.models import resolve_model

    resolve_model("tiny", cache_dir=hostile_work / "model-cache")
    return Bases(hostile_work / "bases", hostile_work / "model-cache")
