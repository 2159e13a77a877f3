"""Record intake: ordering, validation counters, reward recomputation, staleness and reuse caps."""

from __future__ import annotations

import numpy as np
import pytest

from stoa.bucket import open_bucket
from stoa.records import ModelSpec, RolloutRecord, RunContract, Sample, SamplingSpec, rollout_key
from stoa.tasks import get_task
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
        prompt_id="train:1", raw=None):
    prompt = task.get(prompt_id)
    samples = []
    for i, t in enumerate(text):
        toks = np.array(codec.tok.encode(t, add_special_tokens=False), np.int32)
        r = task.reward(prompt, t) if claimed is None else claimed[i]
        samples.append(Sample(toks, np.full(toks.size, -1.0, np.float32), r, "length"))
    rec = RolloutRecord(worker, seq, version, contract.fingerprint(), "toy", prompt_id,
                        np.array(codec.encode_prompt(prompt.messages), np.int32), samples)
    key = rollout_key("r", version, worker, seq)
    bucket.put_create(key, rec.encode() if raw is None else raw)
    return key


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
    np.testing.assert_allclose(pool.entries[key].rewards, [1.0, 0.0])
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
    assert all("/v00000001/" not in k for k in state["uses"])


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
