"""The trainer's lease: one trainer per run, take-over after the TTL, fencing of a trainer that lost it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from stoa.bucket import open_bucket
from stoa.layout import lease_key
from stoa.schemas.control import LeaseRecord
from stoa.trainer.lease import Lease, LeaseHeld, LeaseLost
from tests.integration.conftest import procs  # noqa: F401 - the process fixture


class Clock:
    """A settable wall clock."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def quiet(*_):
    return None


def lease(bucket, clock, **kw) -> Lease:
    return Lease(bucket, "r", ttl_s=10.0, clock=clock, echo=quiet, **kw)


def foreign(held: Lease, host: str = "other-host") -> Lease:
    """Pretend ``held`` runs on another host (so its pid says nothing about liveness here)."""
    held.mine = LeaseRecord(held.mine.holder, host, 4242, held.mine.started, held.mine.heartbeat, 0, held.mine.model)
    return held


def test_a_second_trainer_is_refused_naming_the_holder_host_pid_and_age(tmp_path):
    b, clock = open_bucket(str(tmp_path / "b")), Clock()
    first = foreign(lease(b, clock, model="tiny"))
    assert first.acquire() is None
    clock.t += 3
    with pytest.raises(LeaseHeld) as e:
        lease(b, clock).acquire()
    msg = str(e.value)
    assert first.mine.holder in msg and "other-host" in msg and "pid 4242" in msg and "3s ago" in msg
    assert "--take-over" in msg and "lease_ttl_seconds (10s)" in msg and "\n" not in msg
    rec = LeaseRecord.from_json(b.get(lease_key("r")))
    assert rec is not None and rec.epoch == 1 and rec.model == "tiny"


def test_take_over_needs_a_heartbeat_older_than_the_ttl_and_bumps_the_epoch(tmp_path):
    b, clock = open_bucket(str(tmp_path / "b")), Clock()
    first = foreign(lease(b, clock))
    first.acquire()
    clock.t += 9
    with pytest.raises(LeaseHeld, match="9s ago: --take-over needs it older than lease_ttl_seconds"):
        lease(b, clock).acquire(take_over=True)
    clock.t += 2
    second = lease(b, clock)
    prev = second.acquire(take_over=True)
    assert prev is not None and prev.holder == first.mine.holder
    assert LeaseRecord.from_json(b.get(lease_key("r"))).epoch == 2


def test_a_renewing_holder_keeps_its_lease(tmp_path):
    b, clock = open_bucket(str(tmp_path / "b")), Clock()
    first = foreign(lease(b, clock))
    first.acquire()
    for _ in range(5):
        clock.t += 8
        first.renew()
    with pytest.raises(LeaseHeld):
        lease(b, clock).acquire(take_over=True)  # heartbeat 0s old: a live trainer is never taken over


def test_the_old_holder_is_fenced_after_a_take_over_and_writes_nothing(tmp_path):
    b, clock = open_bucket(str(tmp_path / "b")), Clock()
    old = foreign(lease(b, clock))
    old.acquire()
    clock.t += 11  # old was paused past the TTL
    new = lease(b, clock)
    new.acquire(take_over=True)
    stored = b.get(lease_key("r"))
    with pytest.raises(LeaseLost, match="lost its lease by trainer"):
        old.renew()
    with pytest.raises(LeaseLost):
        old.renew()  # stays lost
    old.release()  # does not touch the new holder's lease
    assert b.get(lease_key("r")) == stored
    new.renew()


def test_a_released_lease_is_taken_at_once_and_a_dead_holder_on_this_host_too(tmp_path):
    b, clock = open_bucket(str(tmp_path / "b")), Clock()
    first = lease(b, clock)
    first.acquire()
    first.release()
    second = lease(b, clock)
    assert second.acquire().released  # no --take-over, no waiting for the TTL
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    second.mine = LeaseRecord(second.mine.holder, second.mine.host, int(dead.stdout), 0, clock(), 2)
    second.renew()  # the lease now names a process of this host that has exited
    third = lease(b, clock)
    assert third.acquire().pid == int(dead.stdout)


def test_a_lease_that_is_not_json_needs_take_over(tmp_path):
    b, clock = open_bucket(str(tmp_path / "b")), Clock()
    b.put(lease_key("r"), b"garbage")  # anyone may write the bucket
    with pytest.raises(LeaseHeld, match="unreadable lease"):
        lease(b, clock).acquire()
    lease(b, clock).acquire(take_over=True)


def test_a_renewal_whose_answer_was_lost_is_not_a_lost_lease(tmp_path):
    b, clock = open_bucket(str(tmp_path / "b")), Clock()
    mine = lease(b, clock)
    mine.acquire()
    stale = mine.etag
    clock.t += 1
    mine.renew()  # landed; pretend the answer was lost and the etag not updated
    mine.etag = stale
    clock.t += 1
    mine.renew()
    assert LeaseRecord.from_json(b.get(lease_key("r"))).holder == mine.mine.holder


# Process scenarios (tiny model, toy task): the CLI, real signals, a local bucket.

TRAIN = ["--model", "tiny", "--task", "toy", "--n-samples", "4", "--groups-per-step", "2", "--max-new-tokens", "8",
         "--eval-n", "0", "--kl-beta", "0", "--poll-seconds", "0.2", "--lease-ttl-seconds", "3"]


def snapshot(root) -> dict[str, str]:
    """Every object of a local bucket (temp and lock files aside) and its content hash."""
    from stoa.bucket.base import file_digest

    return {str(p.relative_to(root)): file_digest(p) for p in sorted(root.rglob("*"))
            if p.is_file() and ".stoa" not in p.relative_to(root).parts}


def journal_step(url: str, run: str) -> int:
    from stoa.trainer import checkpoint as ckpt

    return int((ckpt.read_journal(open_bucket(url), run) or {}).get("step", 0))


@pytest.mark.slow
def test_a_second_trainer_is_refused_and_one_after_a_sigkill_resumes_without_flags(procs, tmp_path):  # noqa: F811
    from tests.integration.conftest import wait_for

    url = str(tmp_path / "bucket")
    t1 = procs.start("t1", "trainer", "--bucket", url, "--run", "r", *TRAIN)
    wait_for(lambda: "published v1" in procs.log("t1"), 120, "the first trainer to publish v1")
    t2 = procs.start("t2", "trainer", "--bucket", url, "--run", "r", *TRAIN)
    assert t2.wait(timeout=120) == 6, procs.log("t2")
    holder = LeaseRecord.from_json(open_bucket(url).get(lease_key("r")))
    assert f"held by trainer {holder.holder} on host {holder.host} (pid {t1.pid})" in procs.log("t2")
    assert "Traceback" not in procs.log("t2") and t1.poll() is None
    t1.send_signal(signal.SIGKILL)
    t1.wait(timeout=30)
    # The holder died on this host: a new trainer takes over at once, with only --bucket and --run.
    t3 = procs.start("t3", "trainer", "--bucket", url, "--run", "r", "--max-wait-seconds", "1")
    assert t3.wait(timeout=120) == 5, procs.log("t3")
    log = procs.log("t3")
    assert f"took over run 'r' from trainer {holder.holder}" in log and "resumed run r at v1" in log, log
    assert "model tiny (as its last trainer)" in log
    t4 = procs.start("t4", "trainer", "--bucket", url, "--run", "r", "--n-samples", "6")
    assert t4.wait(timeout=120) == 3, procs.log("t4")
    assert "n_samples (run 'r' has 4, --n-samples says 6; leave --n-samples out" in procs.log("t4")


def _settled(url: str, quiet_s: float = 1.5):
    """A predicate: the run's journal step has not moved for ``quiet_s`` seconds."""
    seen = {"step": -1, "since": time.monotonic()}

    def settled() -> bool:
        step = journal_step(url, "r")
        if step != seen["step"]:
            seen.update(step=step, since=time.monotonic())
        return time.monotonic() - seen["since"] >= quiet_s

    return settled


@pytest.mark.slow
def test_a_paused_trainer_that_lost_its_lease_exits_without_a_single_write(procs, tmp_path):  # noqa: F811
    from tests.integration.conftest import wait_for

    url = str(tmp_path / "bucket")
    run = ["--bucket", url, "--run", "r"]
    t1 = procs.start("t1", "trainer", *run, *TRAIN, "--lr", "3e-2")
    wait_for(lambda: "published v1" in procs.log("t1"), 120, "the first trainer to publish v1")
    w0 = procs.start("w0", "worker", *run, "--name", "w0", "--engine", "torch", "--threads", "1",
                     "--poll-seconds", "0.2", "--wait-seconds", "120", "--groups-in-flight", "2")
    wait_for(lambda: journal_step(url, "r") >= 2, 240, "two steps of the first trainer")
    # A stop that lands after a write's fence check but before the write commits cannot be fenced on a local
    # directory (no conditional writes): that write completes on SIGCONT. So the first trainer is paused while
    # it idles between polls: the worker pauses first and the trainer's step count has settled.
    w0.send_signal(signal.SIGSTOP)
    wait_for(_settled(url), 60, "the first trainer to finish the steps its pool allows")
    t1.send_signal(signal.SIGSTOP)
    time.sleep(4)  # past the 3 s TTL
    target = journal_step(url, "r") + 2
    w0.send_signal(signal.SIGCONT)
    t2 = procs.start("t2", "trainer", *run, "--take-over", "--lease-ttl-seconds", "3", "--steps", str(target))
    assert t2.wait(timeout=240) == 0, procs.log("t2")
    assert "took over run 'r'" in procs.log("t2")
    w0.kill()
    w0.wait(timeout=30)
    before = snapshot(tmp_path / "bucket")
    t1.send_signal(signal.SIGCONT)
    assert t1.wait(timeout=120) == 7, procs.log("t1")
    assert snapshot(tmp_path / "bucket") == before  # not one object written, overwritten or deleted
    assert "lost its lease" in procs.log("t1") and "Traceback" not in procs.log("t1")


def test_a_trainer_paused_mid_publish_writes_no_patch_after_a_take_over(tmp_path, stoa_cache):
    from stoa.config import TrainerConfig
    from stoa.trainer.loop import _Trainer
    from stoa.weights.planes import state_from_f32

    url = str(tmp_path / "b")
    cfg = TrainerConfig(bucket=url, run="r", model="tiny", task="toy", n_samples=2, eval_n=0, kl_beta=0.0,
                        lease_ttl_seconds=0.4).validate()
    old = _Trainer(cfg, echo=quiet)
    old.resume()  # v1
    state = state_from_f32(old.policy.export_f32(), "bf16")  # encoded, about to be written...
    old.lease._stop.set()  # ...when the process is paused: no heartbeat either
    time.sleep(0.5)
    Lease(open_bucket(url), "r", ttl_s=0.4, echo=quiet).acquire(take_over=True)
    before = snapshot(tmp_path / "b")
    with pytest.raises(LeaseLost):
        old.publisher.publish(2, state)  # straight to the bucket writes, past the step's own fence
    assert snapshot(tmp_path / "b") == before
