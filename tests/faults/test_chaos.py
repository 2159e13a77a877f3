"""kill -9 chaos over a local bucket: trainer and workers die at seeded random moments and restart; then an audit."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from stoa.bucket import open_bucket
from tests.faults.audit import (
    PointerWatch,
    acknowledged_keys,
    audit_records,
    fresh_sync,
    history_problems,
    rebuild_chain,
    rejected_counts,
    reward_mismatches,
    short_key,
    trained_uses,
)
from tests.integration.conftest import Procs, train_rows, wait_for
from tests.integration.test_loop_local import TRAIN_ARGS, worker_args

SEED = 1729
REUSE_CAP = 2
# Three trainer kills and three worker kills, in a seeded order, each at a seeded moment.
VICTIMS = ["trainer", "trainer", "trainer", "worker", "worker", "worker"]
# While a trainer restarts, the workers are paused (SIGSTOP) and stay paused for this long after it resumed, so
# the new trainer must reuse what the dead one left in the window: the journaled use counts are what keep it
# within the cap (unpaused, hundreds of fresh records pile up during a restart and nothing needs reuse).
STARVE_S = 3.0
# A small learning rate keeps the tiny policy from collapsing onto one token: honest workers then never sample
# identical groups, which the content identity would count as duplicates.
LR = "1e-3"
# A wide window keeps the dead trainer's records usable while the new one starves, so it takes each to the cap.
STALENESS = "8"


class Chaos:
    """Runs the trainer and two workers, kills one with SIGKILL at a random moment, restarts it."""

    def __init__(self, procs: Procs, bucket: str, run: str, watch: PointerWatch, rng: random.Random):
        self.procs, self.bucket, self.run, self.watch, self.rng = procs, bucket, run, watch, rng
        self.trainer_args = ["trainer", "--bucket", bucket, "--run", run, *TRAIN_ARGS, "--steps", "0", "--lr", LR,
                             "--keep-rollout-versions", "-1", "--no-backpressure",
                             "--staleness-bound", STALENESS,
                             "--reuse-cap", str(REUSE_CAP), "--keep-versions", "1000"]
        self.starts = {"trainer": 0, "w0": 0, "w1": 0}
        self.live: dict[str, subprocess.Popen] = {}
        self.kills: list[str] = []

    def start(self, name: str) -> None:
        label = f"{name}-{self.starts[name]}"
        self.starts[name] += 1
        args = self.trainer_args if name == "trainer" else worker_args(self.bucket, self.run, name)
        self.live[name] = self.procs.start(label, *args)

    def version(self) -> int:
        return self.watch.history[-1][0] if self.watch.history else 0

    def kill_one(self, victim: str) -> None:
        """Wait for the run to move on, then for a random moment, and SIGKILL ``victim`` (it must be running)."""
        v0 = self.version()
        wait_for(lambda: self.version() > v0, 180, f"a new version before killing {victim}", interval=0.05)
        time.sleep(self.rng.uniform(0.0, 1.5))
        p = self.live[victim]
        assert p.poll() is None, f"{victim} exited on its own:\n{self.procs.log(f'{victim}-{self.starts[victim] - 1}')}"
        p.send_signal(signal.SIGKILL)
        assert p.wait(timeout=30) == -signal.SIGKILL
        self.kills.append(f"{victim}@v{self.version()}")
        if victim != "trainer":
            self.start(victim)
            return
        workers = [self.live["w0"], self.live["w1"]]
        for w in workers:
            w.send_signal(signal.SIGSTOP)
        try:
            self.start("trainer")
            log = f"trainer-{self.starts['trainer'] - 1}"
            wait_for(lambda: "resumed run" in self.procs.log(log), 120, f"{log} to resume")
            time.sleep(STARVE_S)
        finally:
            for w in workers:
                w.send_signal(signal.SIGCONT)


@pytest.mark.slow
def test_kill_9_at_random_moments_keeps_versions_weights_records_and_reuse_counts(procs, tmp_path):
    run, root = "chaos", tmp_path / "bucket"
    bucket = open_bucket(str(root))
    rng = random.Random(SEED)
    order = [v if v == "trainer" else rng.choice(["w0", "w1"]) for v in rng.sample(VICTIMS, len(VICTIMS))]
    with PointerWatch(bucket, run) as watch:
        chaos = Chaos(procs, str(root), run, watch, rng)
        for name in ("trainer", "w0", "w1"):
            chaos.start(name)
        for victim in order:
            chaos.kill_one(victim)
        v_end = chaos.version()
        wait_for(lambda: chaos.version() >= v_end + 2, 180, "two versions after the last restart", interval=0.05)
        chaos.live["trainer"].send_signal(signal.SIGTERM)  # graceful: finishes its step
        assert chaos.live["trainer"].wait(timeout=120) == 0, procs.log(f"trainer-{chaos.starts['trainer'] - 1}")
        for name in ("w0", "w1"):
            chaos.live[name].send_signal(signal.SIGKILL)
            chaos.live[name].wait(timeout=30)
        time.sleep(0.2)  # one more look at the pointer
    print(f"\nkills: {chaos.kills}; pointer changes seen: {len(watch.history)}, final v{chaos.version()}")
    assert all(f"resumed run {run}" in procs.log(f"trainer-{i}") for i in range(1, chaos.starts["trainer"]))
    _audit(bucket, run, root / "runs" / run / "metrics", watch)


def _audit(bucket, run: str, metrics_dir: Path, watch: PointerWatch) -> None:
    # Versions: every version from v1 to the pointer is an anchor or a patch that applies; every pointer
    # seen strictly increased and named the state the chain reaches at its version.
    chain = rebuild_chain(bucket, run, "bf16")
    synced = fresh_sync(bucket, run, "bf16")
    final = synced.pointer
    assert chain.problems == []
    assert sorted(chain.hashes) == list(range(1, final.version + 1))
    assert watch.errors == [] and history_problems(watch.history, chain) == []
    assert watch.history[-1] == (final.version, final.state_hash)
    # Weights: a fresh worker rebuilds exactly the pointer's state from anchors + patches.
    assert (synced.version, synced.state_hash) == (final.version, final.state_hash)
    assert chain.hashes[final.version] == final.state_hash
    # Records: every object readable and valid; every acknowledged upload is there.
    records = audit_records(bucket, run)
    assert records.bad == {}
    acked = {k for keys in acknowledged_keys(metrics_dir, run).values() for k in keys}
    assert acked and acked <= set(records.keys), sorted(acked - set(records.keys))[:5]
    # Trainer: versions never repeat, each published; reuse within the cap; honest workers never rejected.
    rows = train_rows(metrics_dir / "trainer.jsonl")
    versions = [r["version"] for r in rows]
    assert all(b > a for a, b in zip(versions, versions[1:], strict=False)), versions
    assert set(versions) <= set(chain.hashes)
    uses = trained_uses(rows)
    assert max(uses.values()) <= REUSE_CAP, uses.most_common(3)
    assert set(uses) <= {short_key(k) for k in records.keys}
    assert rejected_counts(rows) == {} and reward_mismatches(rows) == 0
