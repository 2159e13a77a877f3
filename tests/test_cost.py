"""Cost accounting: the request classifier, the local bucket's S3-equivalent counts, prices, worker reports."""

from __future__ import annotations

import math

import pytest

from stoa.bucket import open_bucket
from stoa.bucket.meter import CLASS_OF, Counts, RequestMeter, http_request_name
from stoa.observe.costview import cost_lines, cost_view
from stoa.telemetry.cost import MAX_REPORT_STEP, CostClock, Prices, WorkerReports, cost_row, report, storage_usd


def test_requests_fall_in_r2s_billing_classes():
    assert {n for n, c in CLASS_OF.items() if c == "b"} == {"GetObject", "HeadObject"}
    assert {n for n, c in CLASS_OF.items() if c == "a"} == {
        "PutObject", "CopyObject", "ListObjectsV2", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload",
        "DeleteObjects"}
    assert CLASS_OF["DeleteObject"] == CLASS_OF["AbortMultipartUpload"] == "free"
    m = RequestMeter()
    for name in ("GetObject", "HeadObject", "PutObject", "ListObjectsV2", "DeleteObject"):
        m.add(name)
    assert m.counts() == Counts(a=2, b=2, free=1)
    with pytest.raises(ValueError, match="CLASS_OF"):
        m.add("SelectObjectContent")


def test_http_requests_are_named_as_s3_bills_them():
    q = {"list-type": ["2"], "prefix": ["runs/"]}
    assert http_request_name("GET", q) == "ListObjectsV2"
    assert http_request_name("GET", {}) == "GetObject"
    assert http_request_name("HEAD", {}) == "HeadObject"
    assert http_request_name("PUT", {}) == "PutObject"
    assert http_request_name("PUT", {"partNumber": ["1"], "uploadId": ["u"]}) == "UploadPart"
    assert http_request_name("POST", {"uploads": [""]}) == "CreateMultipartUpload"
    assert http_request_name("POST", {"uploadId": ["u"]}) == "CompleteMultipartUpload"
    assert http_request_name("POST", {"delete": [""]}) == "DeleteObjects"
    assert http_request_name("DELETE", {}) == "DeleteObject"


def test_a_local_bucket_counts_what_the_same_calls_cost_on_s3(tmp_path):
    b = open_bucket(str(tmp_path / "b"))
    b.meter = RequestMeter()  # type: ignore[attr-defined]  # the process's METER otherwise
    b.put_create("a/x", b"hello")
    b.put_create("a/x", b"hello")  # identical: S3 PUTs, gets 412, HEADs and GETs to compare
    assert b.get("a/x") == b"hello" and b.get_range("a/x", 0, 2) == b"he"
    assert not b.exists("a/y")
    b.cas("a/c", b"1", None)
    for info in b.list("a/"):  # a delete between a listing's items counts on its own
        b.delete(info.key)
    b.put("a/z", b"z")
    assert b.delete_prefix("a/") == 1
    assert b.meter.by_request() == {  # type: ignore[attr-defined]
        "PutObject": 4, "HeadObject": 2, "GetObject": 3, "ListObjectsV2": 2, "DeleteObjects": 3}
    assert b.meter.counts() == Counts(a=9, b=5, free=0, written=12, read=7)  # type: ignore[attr-defined]


def test_prices_are_r2s_and_configurable():
    p = Prices()
    assert p.requests_usd(Counts(a=1_000_000, b=1_000_000, free=5)) == pytest.approx(4.86)
    assert storage_usd(2e9, 730.0, p) == pytest.approx(0.03)  # 2 GB for a month
    env = Prices.from_env({"STOA_PRICE_CLASS_A": "5", "STOA_PRICE_STORAGE_GB_MONTH": "0.02"})
    assert (env.class_a_per_million, env.class_b_per_million, env.storage_per_gb_month) == (5.0, 0.36, 0.02)
    with pytest.raises(ValueError, match="STOA_PRICE_CLASS_B"):
        Prices.from_env({"STOA_PRICE_CLASS_B": "cheap"})
    with pytest.raises(ValueError, match=">= 0"):
        Prices(class_a_per_million=-1)


def test_cost_row_prices_the_step_the_token_and_the_hour():
    row = cost_row(Counts(a=300_000, b=0), Counts(a=100_000, b=1_000_000), Counts(a=200_000, b=500_000),
                   trained_tokens=1e6, hours=2.0, steps=4, prices=Prices())
    assert row["cost/usd"] == pytest.approx(0.4 * 4.5 + 0.36)
    assert row["cost/step_usd"] == pytest.approx(0.2 * 4.5 + 0.5 * 0.36)
    assert row["cost/usd_per_step"] == pytest.approx(2.16 / 4)
    assert row["cost/usd_per_token"] == pytest.approx(2.16 / 1e6)
    assert row["cost/usd_per_hour"] == pytest.approx(2.16 / 2)
    assert (row["cost/requests_a"], row["cost/workers_b"], row["cost/step_requests_a"]) == (400_000, 1_000_000, 200_000)


def test_cost_clock_counts_steps_and_a_last_row_without_one():
    meter, t = RequestMeter(), [0.0]
    clock = CostClock(meter, Prices(), clock=lambda: t[0])
    meter.add("PutObject", 1000)
    t[0] = 3600.0
    first = clock.row(WorkerReports(), 50.0)
    meter.add("PutObject", 1000)
    last = clock.row(WorkerReports(), 0.0, step=False)
    assert first["cost/step_requests_a"] == 1000 and last["cost/step_requests_a"] == 1000
    assert last["cost/steps"] == 1 and last["cost/usd_per_step"] == pytest.approx(2000 * 4.5e-6)


def test_worker_reports_are_bounded_and_validated():
    r = WorkerReports()
    r.observe("w1", {"generate_s": 1.0})  # an older worker: no report
    r.observe("w1", report(Counts(a=10, b=20, written=100)))
    r.observe("w1", report(Counts(a=5, b=30)))  # fewer: w1 restarted; its 10/20 stay banked
    r.observe("w2", {**report(Counts(a=1)), "bucket/b": -3.0})  # malformed: ignored
    r.observe("w2", {**report(Counts(a=1)), "bucket/a": 2.5})
    r.observe("w3", report(Counts(a=10 * MAX_REPORT_STEP)))  # a flood: one step's worth counts
    assert r.bad == 2 and r.clipped == 9 * MAX_REPORT_STEP
    assert r.total() == Counts(a=15 + MAX_REPORT_STEP, b=50, written=100)


def test_status_cost_takes_the_fresher_worker_figure_and_skips_hostile_values():
    trainer = [{"cost/trainer_a": 100, "cost/trainer_b": 10, "cost/workers_a": 50, "cost/workers_b": 500,
                "cost/steps": 10, "cost/trained_tokens": 1000.0, "cost/hours": 0.5}]
    workers = [[{"bucket/a": 40, "bucket/b": 300}, {"bucket/a": 70, "bucket/b": 400}],
               [{"bucket/a": float("nan"), "bucket/b": "lots"}], [{"bucket/a": -1000.0}]]
    c = cost_view(trainer, workers, 2_000_000_000, Prices())
    assert c is not None and c.requests == Counts(a=170, b=510)
    assert c.usd == pytest.approx((170 * 4.5 + 510 * 0.36) / 1e6)
    assert c.per(c.steps) == pytest.approx(c.usd / 10) and c.per(0) is None
    assert c.storage_usd_per_hour == pytest.approx(2 * 0.015 / 730)
    text = "\n".join(cost_lines(c, 11))
    assert "/step" in text and "/trained token" in text and "/hour" in text and "170 class A" in text
    assert cost_view([{"train/loss": 1.0}], [], 0, Prices()) is None


def test_the_dry_run_estimate_follows_the_settings_and_the_fleet():
    from dataclasses import replace

    from stoa.config import TrainerConfig
    from stoa.telemetry.costplan import estimate_cost, estimate_lines

    cfg = replace(TrainerConfig(), staleness_bound=3, groups_per_step=8, anchor_every=16, checkpoint_minutes=0.0)
    one, many = estimate_cost(cfg, 1, 135e6), estimate_cost(cfg, 100, 135e6)
    # trainer: 2 window listings of 4 versions, 5 control writes, weights (an anchor of 19 parts + manifest every
    # 16 versions, a 1-PUT patch otherwise), a patch and a rollout version deleted, a metrics chunk every 20 steps
    assert one.trainer_step == Counts(a=math.ceil(8 + 5 + (20 + 15) / 16 + 1 + 3 / 16 + 2 + 1 / 20), b=8)
    assert one.workers_step == Counts(a=8, b=2) and many.workers_step == Counts(a=8, b=200)
    assert many.workers_hour.b == 100 * 0.2 * 2 * 7200 and many.workers_hour.a == 6000
    assert one.checkpoint.a == math.ceil(135e6 * 12 / (16 << 20)) + 2 + 4
    assert one.checkpoints_per_hour(10.0) == 0.0 and estimate_cost(replace(cfg, checkpoint_every=36), 1, 135e6) \
        .checkpoints_per_hour(10.0) == 10.0
    assert estimate_cost(replace(cfg, checkpoint_minutes=30.0), 1, 135e6).checkpoints_per_hour(10.0) == 2.0
    assert many.usd_per_hour(10.0, Prices()) > one.usd_per_hour(10.0, Prices()) > one.usd_per_hour(60.0, Prices())
    assert any("per trained token" in line for line in estimate_lines(one, Prices()))
    with pytest.raises(ValueError, match="--fleet-size"):
        estimate_cost(cfg, 0, None)


def test_a_lora_runs_estimate_publishes_the_adapter_and_stores_the_base_once():
    from dataclasses import replace

    from stoa.config import TrainerConfig
    from stoa.telemetry.costplan import ADAPTER_PATCH_SHARE, estimate_cost

    cfg = replace(TrainerConfig(), staleness_bound=3, groups_per_step=8, anchor_every=16, checkpoint_minutes=0.0)
    full, lora = estimate_cost(cfg, 1, 135e6), estimate_cost(cfg, 1, 135e6, adapter_params=4.9e6)
    # the adapter's anchor (9.8 MB) is one PUT, the full weights' (270 MB) 17 parts + create/complete
    assert lora.trainer_step.a < full.trainer_step.a
    assert lora.checkpoint.a == 1 + 4 and full.checkpoint.a == math.ceil(135e6 * 12 / (16 << 20)) + 2 + 4
    window = full.stored_bytes - 135e6 * 2 * (cfg.keep_versions * 0.02 + 1) - 135e6 * 12 * cfg.keep_checkpoints
    assert lora.stored_bytes == pytest.approx(135e6 * 2 + 9.8e6 * (cfg.keep_versions * ADAPTER_PATCH_SHARE + 1)
                                              + 4.9e6 * 12 * cfg.keep_checkpoints + window)


def test_status_prices_the_trainers_row_and_fresher_worker_rows_without_another_get(tmp_path):
    import time

    from stoa.observe.snapshot import take_snapshot
    from stoa.observe.status import render
    from tests.observe.test_status import RUN, _chunks, write_run

    bucket, now = open_bucket(str(tmp_path / "b")), time.time()
    write_run(bucket, now)
    _chunks(bucket, "trainer", now - 30, [{"time": now - 4, "cost/trainer_a": 7, "cost/steps": 1},
                                          {"time": now - 2, "cost/trainer_a": 1000, "cost/trainer_b": 100,
                                           "cost/workers_a": 10, "cost/workers_b": 20, "cost/steps": 4,
                                           "cost/trained_tokens": 400.0, "cost/hours": 0.01}], flush_rows=3)
    _chunks(bucket, "worker-w1", now - 20, [{"time": now - 3, "worker/version": 5, "bucket/a": 50.0,
                                              "bucket/b": 5.0}], flush_rows=1)
    snap = take_snapshot(bucket, RUN, now=now, prices=Prices(class_a_per_million=1e6, class_b_per_million=1e6))
    assert snap.cost is not None and snap.cost.requests == Counts(a=1050, b=120)
    assert snap.cost.usd == pytest.approx(1170.0) and snap.cost.per(snap.cost.steps) == pytest.approx(292.5)
    assert snap.requests["get"] == 8  # status, pointer, lease, journal, 3 trainer chunks, w1's newest: no more
    assert "1050 class A, 120 class B" in render(snap)
