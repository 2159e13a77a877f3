"""A tiny trainer + 2 workers run over S3 through the fault proxy: it completes, loses nothing, trains nothing twice."""

from __future__ import annotations

import pytest

from stoa.bucket import open_bucket
from tests.bucket.conftest import MOTO_SECRET, TEST_BUCKET, moto_env
from tests.faults.audit import (
    acknowledged_keys,
    audit_records,
    fresh_sync,
    rebuild_chain,
    rejected_counts,
    reward_mismatches,
    short_key,
    trained_uses,
)
from tests.faults.proxy import FAULT_KINDS, FaultProxy, FaultRates
from tests.integration.conftest import train_rows
from tests.integration.test_loop_local import TRAIN_ARGS

AUDIT_ARGS = ["--keep-rollout-versions", "-1", "--no-backpressure"]
"""Keep every record for the audit, and let workers sample freely (the audit counts what they upload)."""

RATES = FaultRates(error_5xx=0.06, latency=0.06, cut_body=0.06, drop_after_write=0.1, max_latency_s=0.2)
# 24 records for 8 steps x 4 groups: some records are used twice, so the reuse cap is reached.
STEPS, GROUPS_PER_WORKER, REUSE_CAP = 8, 12, 2


def area(method: str, path: str) -> str:
    """What a request touches, for the fault counts: listing, record, pointer, weights, trainer state, other."""
    if "list-type=" in path:
        return "list"
    for part, name in (("/rollouts/", "record"), ("/current.json", "pointer"), ("/weights/", "weights"),
                       ("/trainer/", "trainer"), ("/model/", "model")):
        if part in path:
            return f"{name}:{method}"
    return f"other:{method}"


@pytest.mark.slow
def test_run_through_a_faulty_s3_proxy_loses_nothing_and_trains_nothing_twice(procs, tmp_path, moto_endpoint):
    run, url, logs = "faulty", f"s3://{TEST_BUCKET}/faults", tmp_path / "logs"
    with FaultProxy(moto_endpoint, RATES, seed=20240611, lifetime_s=600, label=area) as proxy:
        procs.env.update({**moto_env(proxy.url), "STOA_BUCKET_RETRY_TIMEOUT_S": "120"})
        trainer = procs.start("trainer", "trainer", "--bucket", url, "--run", run, "--steps", str(STEPS),
                              "--log-dir", str(logs), *TRAIN_ARGS, "--staleness-bound", "20", "--keep-versions", "21",
                              "--reuse-cap", str(REUSE_CAP), *AUDIT_ARGS,
                              "--worker-keys", "off")  # a private fleet: this test is about the bucket's faults
        workers = [procs.start(f"w{i}", "worker", "--bucket", url, "--run", run, "--name", f"w{i}", "--engine",
                               "torch", "--threads", "1", "--poll-seconds", "0.2", "--wait-seconds", "120",
                               "--log-dir", str(logs), "--max-groups", str(GROUPS_PER_WORKER)) for i in range(2)]
        assert trainer.wait(timeout=400) == 0, procs.log("trainer")[-3000:]
        for i, w in enumerate(workers):
            assert w.wait(timeout=120) == 0, procs.log(f"w{i}")[-3000:]
        counts = proxy.counts()
    print(f"\nfault proxy counts: {dict(sorted(counts.items()))}")
    assert all(counts.get(kind, 0) >= 3 for kind in FAULT_KINDS), counts
    assert MOTO_SECRET not in procs.log("trainer") + procs.log("w0") + procs.log("w1")

    direct = open_bucket(url, moto_env(moto_endpoint))  # the store as it is, no faults
    acked = acknowledged_keys(logs, run)
    counts = {w: len(k) for w, k in acked.items()}
    # Both workers uploaded; a finished run lets them exit before --max-groups.
    assert len(counts) == 2 and all(0 < c <= GROUPS_PER_WORKER for c in counts.values()), counts
    records = audit_records(direct, run)
    assert records.bad == {}
    acked_all = {k for keys in acked.values() for k in keys}
    assert acked_all <= set(records.keys), sorted(acked_all - set(records.keys))[:5]  # nothing acknowledged is lost

    rows = train_rows(logs / "trainer.jsonl")
    assert [r["version"] for r in rows] == list(range(2, STEPS + 2))
    uses = trained_uses(rows)
    assert max(uses.values()) == REUSE_CAP, uses.most_common(3)  # reached, never passed
    assert set(uses) <= {short_key(k) for k in records.keys}
    assert rejected_counts(rows) == {} and reward_mismatches(rows) == 0

    synced = fresh_sync(direct, run, "bf16")
    assert (synced.version, synced.state_hash) == (STEPS + 1, synced.pointer.state_hash)
    chain = rebuild_chain(direct, run, "bf16")
    assert chain.problems == [] and chain.hashes[STEPS + 1] == synced.pointer.state_hash
