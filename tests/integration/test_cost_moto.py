"""``stoa status``'s cost figures against a server-side count of a moto run's S3 requests."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from urllib.parse import parse_qs

import pytest

from stoa.bucket.meter import CLASS_OF, http_request_name
from tests.integration.conftest import train_rows
from tests.integration.test_loop_local import TRAIN_ARGS

TOLERANCE = 0.05
"""The goal of issue 30: the status figures within 5% of the server's count."""


class CountingMoto:
    """A moto S3 server on 127.0.0.1 that counts every request it answers by S3 request name."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        entry = self.server._server_entry

        def counting_entry() -> None:  # wrap moto's WSGI app once make_server has it
            import moto.moto_server.threaded_moto_server as tms

            real = tms.make_server

            def make(host, port, app, *args, **kwargs):  # noqa: ANN001, ANN202 - werkzeug's signature
                return real(host, port, self._wrap(app), *args, **kwargs)

            tms.make_server = make
            try:
                entry()
            finally:
                tms.make_server = real

        self.server._server_entry = counting_entry  # type: ignore[method-assign]

    def _wrap(self, app):  # noqa: ANN001, ANN202 - a WSGI app
        def counted(environ, start_response):  # noqa: ANN001, ANN202
            name = http_request_name(environ["REQUEST_METHOD"], parse_qs(environ.get("QUERY_STRING", ""),
                                                                       keep_blank_values=True))
            with self._lock:
                self.counts[name] += 1
            return app(environ, start_response)

        return counted

    def by_class(self) -> Counter[str]:
        with self._lock:
            out: Counter[str] = Counter()
            for name, n in self.counts.items():
                out[CLASS_OF[name]] += n
            return out


@pytest.fixture
def counting_moto():
    import boto3

    moto = CountingMoto()
    moto.server.start()
    host, port = moto.server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="k", aws_secret_access_key="s",
                 region_name="us-east-1").create_bucket(Bucket="stoa-cost")
    moto.counts.clear()  # the bucket's creation is the test's, not the run's
    yield moto, endpoint
    moto.server.stop()


@pytest.mark.slow
def test_status_cost_matches_the_servers_count(procs, tmp_path, counting_moto):
    from stoa.bucket import open_bucket
    from stoa.observe.snapshot import take_snapshot
    from stoa.telemetry.cost import Prices

    moto, endpoint = counting_moto
    env = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": endpoint}
    procs.env.update(env)
    bucket, logs = "s3://stoa-cost/ci", tmp_path / "logs"
    trainer = procs.start("trainer", "trainer", "--bucket", bucket, "--run", "cost", "--steps", "6",
                          "--log-dir", str(logs), *TRAIN_ARGS, "--staleness-bound", "20", "--keep-versions", "21",
                          "--worker-keys", "off")  # counting requests, not identities (they add 2 LISTs an intake)
    worker = procs.start("w0", "worker", "--bucket", bucket, "--run", "cost", "--engine", "torch", "--threads", "1",
                         "--poll-seconds", "0.2", "--wait-seconds", "120", "--log-dir", str(logs))
    assert trainer.wait(timeout=300) == 0, procs.log("trainer")
    assert worker.wait(timeout=120) == 0, procs.log("w0")  # it exits when the run reads finished
    rows = train_rows(logs / "trainer.jsonl")
    assert len(rows) == 6
    last = rows[-1]  # the trainer's figures include what the worker's records reported
    assert last["cost/workers_a"] >= sum(r["rollout/accepted"] for r in rows) - 1 and last["cost/workers_b"] > 0
    assert last["cost/usd"] > 0 and last["cost/usd_per_token"] > 0 and last["cost/reports_bad"] == 0
    server = moto.by_class()  # before this process's own requests below
    snap = take_snapshot(open_bucket(bucket, env), "cost", prices=Prices())
    assert snap.cost is not None
    ours = snap.cost.requests
    prices = Prices()
    server_usd = (server["a"] * prices.class_a_per_million + server["b"] * prices.class_b_per_million) / 1e6
    print(f"\nserver: {dict(moto.counts)}\nserver by class: {dict(server)} (${server_usd:.6f})\n"
          f"stoa status: A {ours.a}, B {ours.b}, free {ours.free} (${snap.cost.usd:.6f}, "
          f"{snap.cost.steps} steps, {snap.cost.trained_tokens:.0f} tokens)")
    assert abs(ours.a - server["a"]) <= TOLERANCE * server["a"]
    assert abs(ours.b - server["b"]) <= TOLERANCE * server["b"]
    assert abs(snap.cost.usd - server_usd) <= TOLERANCE * server_usd
