"""Shared fixtures: a per-session model cache holding the tiny model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(autouse=True, scope="session")
def stoa_key_dir(tmp_path_factory) -> Path:
    """Run keys (and keys trusted on first use) of every process of the session, never ~/.config/stoa/keys."""
    os.environ.setdefault("STOA_KEY_DIR", str(tmp_path_factory.mktemp("stoa-keys")))
    return Path(os.environ["STOA_KEY_DIR"])


@pytest.fixture(scope="session")
def stoa_cache(tmp_path_factory) -> Path:
    """A model cache shared by every process of the session, with the tiny model built once."""
    cache = tmp_path_factory.mktemp("stoa-cache")
    os.environ["STOA_CACHE"] = str(cache)
    from stoa.models import resolve_model

    resolve_model("tiny", cache_dir=cache)
    return cache


@pytest.fixture(scope="session")
def tiny_dir(stoa_cache) -> Path:
    """The tiny llama model directory."""
    from stoa.models import resolve_model

    return resolve_model("tiny", cache_dir=stoa_cache)
