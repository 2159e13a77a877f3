"""A run made in seconds: its contract (and status) written with the real writers, no trainer."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import pytest

from stoa.bucket import Bucket, open_bucket
from stoa.contract import ModelSpec, RunContract, SamplingSpec
from stoa.layout import contract_key, status_key
from stoa.schemas.control import RunStatus


def write_run(bucket: Bucket, run: str = "r1", *, task: str = "gsm8k", n_samples: int = 8, plane: str = "bf16",
              retriever: Mapping[str, Any] | None = None, state: str | None = None,
              task_code: tuple[Mapping[str, str], ...] = (), signer: Any = None) -> RunContract:
    """Write a run's contract create-only (as the trainer does, signed by ``signer``'s run key when given), and a
    status when ``state`` is given."""
    contract = RunContract(run_id=run, model=ModelSpec("llama", "c" * 32, "t" * 32, 512), n_samples=n_samples,
                           plane=plane, task_id=task, task_spec={}, reward_version="1",
                           sampling=SamplingSpec(max_new_tokens=16), retriever=dict(retriever or {}),
                           task_code=task_code, created_at=time.time())
    contract = signer.sign_contract(contract) if signer is not None else contract
    bucket.put_create(contract_key(run), contract.to_json())
    if state is not None:
        now = time.time()
        bucket.put(status_key(run), RunStatus(state, 3, now, now).to_json())
    return contract


@pytest.fixture
def local_bucket(tmp_path, monkeypatch) -> str:
    """A local bucket directory; HOME and the stoa cache point into tmp_path, so nothing touches the real home."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("STOA_CACHE", str(tmp_path / "cache"))
    for name in ("STOA_ENV_FILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "R2_ACCOUNT_ID",
                 "R2_ACCESS_KEY_ID", "R2_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    url = str(tmp_path / "bucket")
    open_bucket(url)
    return url
