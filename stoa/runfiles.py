"""Moved to ``stoa.contract`` (contract wait, model file upload/download); kept for imports until the sweep."""

from __future__ import annotations

import time  # noqa: F401  (tests/test_worker_resilience.py patches runfiles.time.sleep until the sweep)

from stoa.contract import (
    MODEL_FILE_SUFFIXES,
    download_model_files,
    model_files_ready,
    upload_model_files,
    wait_for_contract,
)

__all__ = ["MODEL_FILE_SUFFIXES", "download_model_files", "model_files_ready", "upload_model_files",
           "wait_for_contract"]
