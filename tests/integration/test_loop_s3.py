"""The same trainer + worker loop over a real S3 protocol endpoint (moto on 127.0.0.1)."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys

import numpy as np
import pytest

from stoa.identity import IDENTITY_REASONS
from tests.integration.conftest import train_rows, wait_for
from tests.integration.test_loop_local import TRAIN_ARGS


@pytest.fixture(scope="module")
def moto_s3():
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="k", aws_secret_access_key="s",
                 region_name="us-east-1").create_bucket(Bucket="stoa-it")
    yield endpoint
    server.stop()


@pytest.mark.slow
def test_loop_over_moto(procs, tmp_path, moto_s3):
    procs.env.update({"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1",
                      "AWS_ENDPOINT_URL": moto_s3})
    bucket = "s3://stoa-it/ci"
    logs = tmp_path / "logs"
    # A tiny-model worker writes >100 records/s, and the in-process moto server slows down as objects pile
    # up, so workers stop after a fixed number of groups and the trainer may use older records.
    trainer = procs.start("trainer", "trainer", "--bucket", bucket, "--run", "s3run", "--steps", "8",
                          "--log-dir", str(logs), *TRAIN_ARGS, "--staleness-bound", "20", "--keep-versions", "21",
                          "--worker-keys", "auto")
    for i in range(2):  # worker_keys = auto: an s3:// run requires keys; the operator issues one per worker
        key = str(tmp_path / f"w{i}.key")
        issue = ["worker-key", "issue", f"w{i}", "--bucket", bucket, "--run", "s3run", "--out", key]
        wait_for(lambda: subprocess.run([sys.executable, "-m", "stoa", *issue], env=procs.env,  # noqa: B023
                                        capture_output=True).returncode == 0, 120, "the run's contract", 0.5)
        procs.start(f"w{i}", "worker", "--bucket", bucket, "--run", "s3run", "--engine", "torch", "--threads", "1",
                    "--poll-seconds", "0.2", "--wait-seconds", "120", "--log-dir", str(logs),
                    "--max-groups", "60", "--worker-key", key)
    assert trainer.wait(timeout=300) == 0, procs.log("trainer")
    rows = train_rows(logs / "trainer.jsonl")
    assert [r["version"] for r in rows] == list(range(2, 10))
    assert sum(r["rollout/accepted"] for r in rows) >= 8 * 4 // 2  # records flowed through S3
    assert all(np.isfinite(r["train/loss"]) for r in rows)
    assert sum(r["train/patch_bytes"] for r in rows) > 0  # versions after v1 travel as patches
    assert "records must be signed by a worker key" in procs.log("trainer")
    assert not any(r.get(f"rollout/rejected/{reason}") for r in rows for reason in IDENTITY_REASONS)
