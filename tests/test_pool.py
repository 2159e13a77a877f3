"""Record intake: ordering, validation counters, reward recomputation, staleness and reuse caps."""

from __future__ import annotations

from typing import cast

import numpy as np
import pytest

from stoa.bucket import open_bucket
from stoa.contract import ModelSpec, RunContract, SamplingSpec
from stoa.layout import rollout_key
from stoa.rollouts.records import RolloutRecord, Sample
from stoa.tasks import Task, get_task
from stoa.tokenize import TextCodec
from stoa.trainer.pool import RecordPool


@pytest.fixture
def setup(tmp_path, tiny_dir):
    codec = TextCodec(tiny_dir)
    task = get_task("toy")
    contract = RunContract(
        run_id="r", model=ModelSpec("llama", "c", "t", vocab_size=512, eos_token_ids=codec.eos_ids), n_samples=2,
        plane="bf16", task_id="toy", task_spec=task.spec(), reward_version=task.reward_version,
        sampling=SamplingSpec(1.0, 1.0, 8),
    )
    bucket = open_bucket(str(tmp_path / "b"))
    return bucket, contract, task, codec


def put(bucket, contract, task, codec, *, worker="w", seq=0, version=1, text=("aaa", "xyz"), claimed=None,
        prompt_id="train:1", raw=None, lp=None):
    prompt = task.get(prompt_id)
    samples = []
    # Distinct logprobs per (worker, seq) unless given: equal content is one record (a duplicate).
    lp = -1.0 - seq / 64 - sum(map(ord, worker)) / 4096 if lp is None else lp
    for i, t in enumerate(text):
        toks = np.array(codec.tok.encode(t, add_special_tokens=False), np.int32)
        r = task.reward(prompt, t) if claimed is None else claimed[i]
        samples.append(Sample(toks, np.full(toks.size, lp, np.float32), r, "length"))
    rec = RolloutRecord(worker, seq, version, contract.fingerprint(), "toy", prompt_id,
                        np.array(codec.encode_prompt(prompt.messages), np.int32), samples)
    key = rollout_key("r", version, worker, seq)
    bucket.put_create(key, rec.encode() if raw is None else raw)
    return key


def entry(pool, key):
    return next(e for e in pool.entries.values() if e.key == key)


def make_pool(bucket, contract, task, codec, **kw):
    return RecordPool(bucket, contract, task, codec, staleness_bound=kw.get("staleness", 3),
                      reuse_cap=kw.get("reuse_cap", 2))


def test_late_record_that_sorts_first_is_not_missed(setup):
    bucket, contract, task, codec = setup
    pool = make_pool(*setup)
    put(*setup, worker="zz")
    assert pool.refresh(1) == 1
    put(*setup, worker="aa")  # lands later, sorts before the first key
    assert pool.refresh(1) == 1
    assert pool.refresh(1) == 0  # nothing is read twice
    assert pool.available() == 2


def test_bad_records_are_counted_by_reason_and_skipped(setup):
    bucket, contract, task, codec = setup
    pool = make_pool(*setup)
    put(*setup, seq=0)
    put(*setup, seq=1, raw=b"garbage")
    put(*setup, seq=2, text=("a", "b", "c"))  # wrong group size
    put(*setup, seq=3, prompt_id="train:2")
    # Tamper with the prompt tokens: the record claims train:2 but carries other tokens.
    rec = RolloutRecord.decode(bucket.get(rollout_key("r", 1, "w", 3)))
    rec.prompt_tokens = rec.prompt_tokens[:-1]
    rec.seq = 4
    bucket.put_create(rollout_key("r", 1, "w", 4), rec.encode())
    assert pool.refresh(1) == 2
    stats = pool.drain_stats()
    assert stats.accepted == 2
    assert stats.rejected == {"malformed": 1, "group_size": 1, "prompt": 1}


def test_rewards_are_recomputed_not_trusted(setup):
    pool = make_pool(*setup)
    key = put(*setup, text=("aaa", "xyz"), claimed=[0.0, 1.0])
    pool.refresh(1)
    np.testing.assert_allclose(entry(pool, key).rewards, [1.0, 0.0])
    assert pool.drain_stats().reward_mismatch == 1


def test_reuse_cap_and_staleness(setup):
    pool = make_pool(*setup, reuse_cap=2, staleness=1)
    put(*setup, version=1, seq=0)
    put(*setup, version=2, seq=1)
    pool.refresh(2)
    first = pool.take(2)
    assert [e.record.policy_version for e in first] == [2, 1]  # freshest first among unused
    second = pool.take(2)
    assert len(second) == 2 and all(e.uses == 2 for e in second)
    assert pool.take(2) == []  # both hit the cap
    put(*setup, version=1, seq=2)
    pool.refresh(3)  # window is now [2, 3]: v1 records are too stale and never listed
    assert pool.available() == 0
    state = pool.state()
    assert state["records"] and all(version >= 2 for version, _, _ in state["records"].values())


def test_keep_filter_drops_groups_without_charging(setup):
    pool = make_pool(*setup)
    put(*setup, seq=0, text=("aaa", "aaa"))  # zero variance
    put(*setup, seq=1, text=("aaa", "xyz"))
    pool.refresh(1)
    taken = pool.take(2, keep=lambda r: bool(r.std() > 0))
    assert len(taken) == 1 and taken[0].rewards.std() > 0
    assert pool.drain_stats().filtered == 1


def test_restore_respects_reuse_counts(setup):
    pool = make_pool(*setup, reuse_cap=1)
    put(*setup, seq=0)
    pool.refresh(1)
    pool.take(1)
    state = pool.state()
    pool2 = make_pool(*setup, reuse_cap=1)
    pool2.restore(state)
    pool2.refresh(1)
    assert pool2.available() == 0


def test_restart_keeps_use_counts_below_a_cap_of_two(setup):
    pool = make_pool(*setup, reuse_cap=2)
    put(*setup, seq=0)
    pool.refresh(1)
    assert len(pool.take(1)) == 1
    pool2 = make_pool(*setup, reuse_cap=2)  # a restarted trainer re-reads the record
    pool2.restore(pool.state())
    pool2.refresh(1)
    again = pool2.take(1)
    assert len(again) == 1 and again[0].uses == 2
    assert pool2.take(1) == [] and pool2.available() == 0


def test_entries_leave_exactly_when_they_leave_the_window(setup):
    pool = make_pool(*setup, reuse_cap=2, staleness=1)
    put(*setup, version=1, seq=0)
    put(*setup, version=2, seq=1)
    pool.refresh(2)
    assert pool.available() == 2
    pool.refresh(3)  # window [2, 3]: the v1 entry, never used, goes; the v2 entry stays
    assert [e.record.policy_version for e in pool.entries.values()] == [2]
    assert pool.drain_stats().dropped_stale == 1


class CountingBucket:
    """Wraps a bucket and records which keys were fetched."""

    def __init__(self, inner):
        self.inner, self.fetched = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get(self, key):
        self.fetched.append(key)
        return self.inner.get(key)


def test_foreign_and_nested_keys_are_rejected_once_and_never_read(setup, tmp_path):
    bucket, contract, task, codec = setup
    good = put(*setup, seq=0)
    data = bucket.get(good)
    bucket.put_create("runs/r/rollouts/v00000001/sub/x.rec", data)  # nested copy of a valid record
    bucket.put_create("runs/r/rollouts/v00000001/w-1.rec", data)  # seq not 8 digits
    bucket.put_create("runs/r/rollouts/v00000001/w-00000009.rec.tmp", data)
    vdir = tmp_path / "b" / "runs" / "r" / "rollouts" / "v00000001"
    for name in ("w\\x-00000001.rec", "w\nx-00000002.rec", "w x-00000003.rec"):
        (vdir / name).write_bytes(data)  # names the bucket API would refuse, planted on disk
    counting = CountingBucket(bucket)
    pool = make_pool(counting, contract, task, codec)
    for _ in range(3):
        pool.refresh(1)
    stats = pool.drain_stats()
    assert stats.accepted == 1 and stats.rejected == {"key": 6}
    assert counting.fetched == [good]
    assert [e.key for e in pool.take(8)] == [good]


def test_oversize_objects_are_judged_by_the_listing_and_never_fetched(setup, monkeypatch):
    bucket, contract, task, codec = setup
    import stoa.trainer.pool as pool_mod

    key = put(*setup, seq=0)
    monkeypatch.setattr(pool_mod, "MAX_RECORD_BYTES", len(bucket.get(key)) - 1)
    counting = CountingBucket(bucket)
    pool = make_pool(counting, contract, task, codec)
    pool.refresh(1)
    assert pool.drain_stats().rejected == {"oversize": 1}
    assert counting.fetched == []


def test_copies_under_other_keys_count_as_one_record(setup):
    bucket, contract, task, codec = setup
    key = put(*setup, seq=0)
    data = bucket.get(key)
    for seq in range(1, 6):  # byte-identical copies under fresh, well-formed keys
        bucket.put_create(rollout_key("r", 1, "w", seq), data)
    relabelled = RolloutRecord.decode(data)
    relabelled.worker_id, relabelled.seq = "other", 7
    bucket.put_create(rollout_key("r", 1, "other", 7), relabelled.encode())
    pool = make_pool(*setup, reuse_cap=2)
    pool.refresh(1)
    trained = pool.take(8) + pool.take(8) + pool.take(8)
    assert len(trained) == 2  # one content, trained up to the cap
    assert pool.drain_stats().rejected == {"duplicate": 6}


def test_a_copy_after_a_restart_is_still_a_duplicate(setup):
    bucket, contract, task, codec = setup
    key = put(*setup, seq=0)
    pool = make_pool(*setup, reuse_cap=2)
    pool.refresh(1)
    pool.take(1)
    pool.take(1)
    pool2 = make_pool(*setup, reuse_cap=2)
    pool2.restore(pool.state())
    bucket.put_create(rollout_key("r", 1, "w", 5), bucket.get(key))
    pool2.refresh(1)
    assert pool2.take(8) == []
    # The copy is a duplicate; the used-up original, read again by the restarted trainer, is no rejection
    # (an honest worker must not look like a rejecting one after a restart).
    stats = pool2.drain_stats()
    assert stats.rejected == {"duplicate": 1} and stats.accepted == 0 and not pool2.entries


class FailingListBucket(CountingBucket):
    def list(self, prefix, start_after=None):
        from stoa.bucket import BucketUnreachable

        raise BucketUnreachable("endpoint down")


def test_a_listing_outage_does_not_stop_the_trainer(setup):
    bucket, contract, task, codec = setup
    pool = make_pool(FailingListBucket(bucket), contract, task, codec)
    assert pool.refresh(1) == 0


class GateSpy:
    def __init__(self):
        self.seen = []

    def observe(self, worker_id, accepted):
        self.seen.append((worker_id, accepted))

    def is_quarantined(self, worker_id):
        return False


def test_duplicates_are_not_held_against_a_worker_but_bad_records_are(setup):
    bucket, contract, task, codec = setup
    key = put(*setup, seq=0)
    bucket.put_create(rollout_key("r", 1, "w", 1), bucket.get(key))  # a copy under the worker's id
    bucket.put_create(rollout_key("r", 1, "w", 2), b"garbage")
    gate = GateSpy()
    pool = RecordPool(bucket, contract, task, codec, staleness_bound=3, reuse_cap=2, gate=gate)
    pool.refresh(1)
    assert pool.drain_stats().rejected == {"duplicate": 1, "malformed": 1}
    assert sorted(gate.seen) == [("w", False), ("w", True)]


def test_records_of_a_worker_quarantined_after_intake_are_not_trained(setup):
    bucket, contract, task, codec = setup
    put(*setup, worker="bad", seq=0)
    put(*setup, worker="good", seq=0)
    gate = GateSpy()
    pool = RecordPool(bucket, contract, task, codec, staleness_bound=3, reuse_cap=2, gate=gate)
    pool.refresh(1)
    gate.is_quarantined = lambda worker_id: worker_id == "bad"  # judged later, e.g. by lag-0 disagreement
    assert [e.record.worker_id for e in pool.take(8)] == ["good"]
    assert pool.drain_stats().rejected == {"quarantined": 1}


def test_a_header_worker_other_than_the_keys_is_a_key_rejection(setup):
    bucket, contract, task, codec = setup
    rec = RolloutRecord.decode(bucket.get(put(*setup, worker="w", seq=0)))
    rec.worker_id, rec.seq = "someone-else", 1
    bucket.put_create(rollout_key("r", 1, "w", 1), rec.encode())
    pool = make_pool(*setup)
    pool.refresh(1)
    assert pool.drain_stats().rejected == {"key": 1}


def test_groups_whose_rewards_all_agree_are_skipped_before_training_and_not_charged(setup):
    pool = make_pool(*setup)
    put(*setup, seq=0, text=("aaa", "aaa"))  # equal rewards: no advantage
    put(*setup, seq=1, text=("aaa", "xyz"))
    put(*setup, seq=2, text=("xyz", "xyz"), lp=-3.0)
    assert pool.refresh(1) == 3
    taken = pool.take(3, skip_uniform=True)
    assert [e.key.rsplit("-", 1)[1] for e in taken] == ["00000001.rec"]
    stats = pool.drain_stats()
    assert stats.skipped_uniform == 2 and stats.filtered == 0
    assert pool.available() == 1  # the informative group stays for its second use; the uniform ones are gone
    # Keeping them (KL-only steps): all three are trained on.
    kept = make_pool(*setup)
    kept.refresh(1)
    assert len(kept.take(3)) == 3 and kept.drain_stats().skipped_uniform == 0


class FlakyRewardTask:
    """The toy task with the reward code of a user's plugin that raises on some completions."""

    def __init__(self, task):
        self.inner = task
        self.id, self.reward_version = task.id, task.reward_version

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def reward(self, prompt, completion):
        if "x" in completion:
            raise ZeroDivisionError("the user's reward code divided by zero")
        return self.inner.reward(prompt, completion)


def test_reward_code_that_raises_rejects_that_record_only_and_is_not_held_against_the_worker(setup):
    bucket, contract, task, codec = setup
    put(*setup, seq=0, text=("aaa", "xyz"))  # "xyz" trips the reward code
    put(*setup, seq=1, text=("aaa", "aab"))
    gate = GateSpy()
    pool = RecordPool(bucket, contract, cast(Task, FlakyRewardTask(task)), codec, staleness_bound=3, reuse_cap=2,
                      gate=gate)
    assert pool.refresh(1) == 1
    assert pool.drain_stats().rejected == {"reward_raised": 1}
    assert gate.seen == [("w", True)]  # the trainer's own reward code failed: no mark against the worker


def test_a_record_relabelled_to_a_newer_version_is_a_replay_not_held_against_anyone(setup):
    bucket, contract, task, codec = setup
    key = put(*setup, seq=0, version=1)
    gate = GateSpy()
    pool = RecordPool(bucket, contract, task, codec, staleness_bound=3, reuse_cap=2, gate=gate)
    pool.refresh(1)
    replay = RolloutRecord.decode(bucket.get(key))
    replay.worker_id, replay.policy_version = "copier", 2  # the same samples and logprobs, claimed at v2
    bucket.put_create(rollout_key("r", 2, "copier", 0), replay.encode())
    put(*setup, seq=1, version=2)  # an honest v2 record with the same text (other logprobs) is no replay
    pool.refresh(2)
    assert pool.drain_stats().rejected == {"replayed": 1}
    assert sorted(e.key for e in pool.entries.values()) == [key, rollout_key("r", 2, "w", 1)]
    assert ("copier", False) not in gate.seen


def test_a_restarted_trainer_still_refuses_a_taken_record_relabelled_to_a_newer_version(setup):
    """The replay memory goes into the journal (through its parser, as a restart reads it): after a restart the
    same samples and logprobs under another version are a replay, though the original has left the window (so
    the restarted pool never reads it again) and only the journal remembers it."""
    from stoa.trainer.checkpoint import read_journal, write_journal

    bucket, contract, task, codec = setup
    key = put(*setup, seq=0, version=1)
    pool = RecordPool(bucket, contract, task, codec, staleness_bound=3, reuse_cap=2)
    pool.refresh(1)
    assert len(pool.take(1)) == 1
    write_journal(bucket, "r", {"version": 2, "step": 1, "pool": pool.state(), "quarantine": {}})
    restarted = RecordPool(bucket, contract, task, codec, staleness_bound=1, reuse_cap=2)
    journal = read_journal(bucket, "r")
    assert journal is not None
    restarted.restore(journal["pool"])
    replay = RolloutRecord.decode(bucket.get(key))
    replay.worker_id, replay.policy_version = "copier", 3
    bucket.put_create(rollout_key("r", 3, "copier", 0), replay.encode())
    restarted.refresh(3)
    assert restarted.drain_stats().rejected == {"replayed": 1} and not restarted.entries
