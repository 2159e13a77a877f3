"""Record intake of a multi-turn task: records are replayed with the trainer's tools, rewards come from the
replayed text, lies are rejected with their reason, and unavailable tools leave records to the next refresh."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from stoa.bucket import open_bucket
from stoa.contract import ModelSpec, RunContract, SamplingSpec
from stoa.layout import rollout_key
from stoa.rollouts.episode import EpisodeLimits, ToolCall
from stoa.rollouts.records import RolloutRecord, Sample
from stoa.tasks.base import Prompt
from stoa.tokenize import TextCodec
from stoa.trainer.pool import RecordPool
from tests.envs.fakes import FakeTools, SearchEnv, honest_sample

GOOD = ["<search>color of y</search>", "<answer>blue</answer>"]
BAD = ["<answer>red</answer>"]


@dataclass
class SearchToyTask:
    """A multi-turn task of the search shape: one prompt per id, the answer is ``blue``."""

    id: str = "searchtoy"
    reward_version: str = "1"
    limits: EpisodeLimits = EpisodeLimits(max_turns=3, max_obs_tokens=64, max_total_tokens=256)
    tool_kind: str = "local"

    def spec(self) -> dict:
        return {"max_turns": 3}

    def get(self, prompt_id: str) -> Prompt:
        return Prompt(prompt_id, ({"role": "user", "content": "What color is y?"},), "blue")

    def reward(self, prompt: Prompt, completion: str) -> float:
        return float(f"<answer>{prompt.answer}</answer>" in completion)

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        return self.reward(prompt, completion) == 1.0

    def make_env(self, prompt: Prompt, seed: int) -> SearchEnv:
        return SearchEnv(seed)

    def make_tools(self, searcher) -> FakeTools:
        return FakeTools()


@pytest.fixture
def setup(tmp_path, tiny_dir):
    codec = TextCodec(tiny_dir)
    task = SearchToyTask()
    contract = RunContract(
        run_id="r", model=ModelSpec("llama", "c", "t", vocab_size=512, eos_token_ids=codec.eos_ids), n_samples=2,
        plane="bf16", task_id=task.id, task_spec=task.spec(), reward_version="1",
        sampling=SamplingSpec(1.0, 1.0, 32),
    )
    return open_bucket(str(tmp_path / "b")), contract, task, codec


def put(setup, samples: list[Sample], *, seq: int = 0, worker: str = "w", env_seed: int = 3) -> str:
    bucket, contract, task, codec = setup
    prompt = task.get("train:1")
    rec = RolloutRecord(worker, seq, 1, contract.fingerprint(), task.id, "train:1",
                        np.array(codec.encode_prompt(prompt.messages), np.int32), samples, env_seed=env_seed)
    key = rollout_key("r", 1, worker, seq)
    bucket.put_create(key, rec.encode())
    return key


def honest(setup, turns, *, seed: int = 3, reward: float = 0.0, lp: float = -0.5) -> Sample:
    return honest_sample(turns, setup[3], seed=seed, reward=reward, lp=lp)


def make_pool(setup, tools=None, gate=None):
    bucket, contract, task, codec = setup
    return RecordPool(bucket, contract, task, codec, staleness_bound=3, reuse_cap=2, gate=gate,
                      tools=FakeTools() if tools is None else tools)


def test_honest_record_is_replayed_and_rewarded_from_the_replay(setup):
    tools = FakeTools()
    pool = make_pool(setup, tools)
    # Claimed rewards lie (1 for the wrong answer): the trainer's come from the replayed text.
    key = put(setup, [honest(setup, GOOD, reward=0.0), honest(setup, BAD, reward=1.0)])
    assert pool.refresh(1) == 1
    entry = next(e for e in pool.entries.values() if e.key == key)
    np.testing.assert_array_equal(entry.rewards, [1.0, 0.0])
    assert entry.replayed is not None and [r.calls for r in entry.replayed] == [1, 0]
    assert entry.replayed[0].text == "\n".join(GOOD) and len(entry.replayed[0].states) == 2
    assert tools.batches == [[ToolCall("search", "color of y")]]  # one request per record
    stats = pool.drain_stats()
    assert stats.accepted == 1 and stats.reward_mismatch == 1 and stats.tool_calls == 1 and stats.replay_s > 0


def test_an_answer_inside_an_observation_earns_nothing(setup):
    """Rewards read the policy's turns only: a document that contains the answer tag is not an answer."""
    tools = FakeTools(docs={"color of y": "<answer>blue</answer>"})
    pool = make_pool(setup, tools)
    wrong = honest_sample(["<search>color of y</search>", "<answer>red</answer>"], setup[3], tools=tools, seed=3)
    key = put(setup, [wrong, honest(setup, BAD)])
    assert pool.refresh(1) == 1
    np.testing.assert_array_equal(next(e for e in pool.entries.values() if e.key == key).rewards, [0.0, 0.0])


class Gate:
    def __init__(self):
        self.seen: list[tuple[str, bool]] = []

    def observe(self, worker_id: str, accepted: bool) -> None:
        self.seen.append((worker_id, accepted))

    def is_quarantined(self, worker_id: str) -> bool:
        return False


def test_injected_document_is_rejected_and_held_against_the_worker(setup):
    gate = Gate()
    pool = make_pool(setup, gate=gate)
    # The worker's retriever "returned" another document; it records the honest digest to pass that check.
    liar = honest_sample(GOOD, setup[3], tools=FakeTools(docs={"color of y": "Y is red, trust me."}), seed=3)
    liar.digests = honest(setup, GOOD).digests
    put(setup, [honest(setup, BAD), liar], worker="evil")
    put(setup, [honest(setup, GOOD), honest(setup, BAD)], seq=1)
    assert pool.refresh(1) == 1
    stats = pool.drain_stats()
    assert stats.rejected == {"observation": 1} and ("evil", False) in gate.seen
    assert stats.tool_calls == 2  # the liar's call was replayed too


def test_lying_roles_and_long_episodes_are_rejected(setup):
    pool = make_pool(setup)
    lie = honest(setup, GOOD)
    lie.roles = np.ones_like(lie.roles)  # observation tokens claimed as sampled
    lie.logprobs = np.full(lie.tokens.size, -0.5, np.float32)
    put(setup, [lie, honest(setup, BAD)], seq=0)
    long = honest(setup, ["<search>a</search>", "<search>b</search>", "<search>c</search>", "<answer>x</answer>"])
    put(setup, [long, honest(setup, BAD)], seq=1)
    single = honest(setup, BAD)
    single.end_reason = ""  # a single-turn (version-1 style) sample is not an episode of this task
    put(setup, [single, honest(setup, BAD)], seq=2)
    assert pool.refresh(1) == 0
    assert pool.drain_stats().rejected == {"roles": 2, "limits": 1}


def test_unavailable_tools_leave_the_record_for_the_next_refresh(setup, caplog):
    tools = FakeTools(fail=True)
    gate = Gate()
    pool = make_pool(setup, tools, gate=gate)
    put(setup, [honest(setup, GOOD), honest(setup, BAD)], seq=0)
    put(setup, [honest(setup, GOOD, lp=-0.25), honest(setup, BAD)], seq=1)
    assert pool.refresh(1) == 0 and pool.refresh(1) == 0
    stats = pool.drain_stats()
    assert stats.rejected == {} and stats.accepted == 0 and gate.seen == []
    assert sum("cannot replay" in r.getMessage() for r in caplog.records) == 1  # warned once
    tools.fail = False
    assert pool.refresh(1) == 2
    assert pool.drain_stats().tool_calls == 2


def test_a_multi_turn_task_needs_tools(setup):
    bucket, contract, task, codec = setup
    with pytest.raises(ValueError, match="tools"):
        RecordPool(bucket, contract, task, codec, staleness_bound=3, reuse_cap=2)


def test_the_turn_cap_is_the_contracts_max_new_tokens(setup):
    pool = make_pool(setup)
    assert pool.limits is not None and pool.limits.max_turn_tokens == 32 and pool.limits.max_turns == 3


def test_replay_off_takes_the_recorded_observations_and_counts_them(setup):
    """replay = false (tools that cannot be replayed): a record whose observation the trainer's tools would not
    give is accepted as recorded, rewarded from the policy's own turns, counted, and no tool is called."""
    bucket, contract, task, codec = setup
    other = honest_sample(GOOD, codec, tools=FakeTools(docs={"color of y": "a live page, changed since"}), seed=3)
    key = put(setup, [other, honest(setup, BAD)])
    strict = make_pool(setup)
    assert strict.refresh(1) == 0 and strict.drain_stats().rejected == {"observation": 1}
    trusting = RecordPool(bucket, contract, task, codec, staleness_bound=3, reuse_cap=2, tools=None, replay=False)
    assert trusting.refresh(1) == 1
    entry = next(e for e in trusting.entries.values() if e.key == key)
    np.testing.assert_array_equal(entry.rewards, [1.0, 0.0])
    assert entry.replayed is not None and entry.replayed[0].text == "\n".join(GOOD)
    assert [r.calls for r in entry.replayed] == [0, 0]
    stats = trusting.drain_stats()
    assert stats.unreplayed == 1 and stats.tool_calls == 0 and stats.rejected == {}


def test_replay_settings_the_task_cannot_honour_are_refused_naming_the_setting(setup):
    from stoa.config.base import ConfigError
    from stoa.tasks import get_task
    from stoa.trainer.setup import check_replay

    task = setup[2]
    assert check_replay(True, task) == ""
    assert "rollout/unreplayed" in check_replay(False, task)
    with pytest.raises(ConfigError, match="replay.*has no tool calls to replay"):
        check_replay(False, get_task("toy"))
    task.deterministic_tools = False  # a live web search
    try:
        with pytest.raises(ConfigError, match=r"replay.*not deterministic.*set replay = false"):
            check_replay(True, task)
    finally:
        del task.deterministic_tools
