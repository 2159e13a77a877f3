"""The built-in search task: ids, splits by entity, answers only in the corpus, the Search-R1 env, rewards."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from stoa.envs.base import Environment, ToolResult, result_hash
from stoa.rollouts.episode import ROLE_ACTION, ROLE_ECHO, ROLE_MASKED, EpisodeLimits, ToolCall
from stoa.tasks import PromptIdError, SearchTask, get_task, is_multiturn, load_task
from stoa.tasks.multiturn import MultiTurnTask, episode_limits
from stoa.tasks.qa import decode_golds, normalize_answer
from stoa.tasks.search import INSTRUCTIONS, SearchEnv
from stoa.tasks.world import build_world

from .conftest import KeywordSearcher, play, text_of


@pytest.fixture(scope="module")
def task() -> SearchTask:
    return SearchTask()


def _question(task: SearchTask, prompt_id: str) -> str:
    content = task.get(prompt_id).messages[-1]["content"]
    assert content.startswith(INSTRUCTIONS)
    return content.rsplit("Question: ", 1)[1]


def test_sizes_and_spec(task: SearchTask) -> None:
    spec = task.spec()
    assert json.loads(json.dumps(spec)) == spec
    assert spec["entities"] == 1000 and spec["seed"] == 0
    assert 2000 <= spec["n_docs"] <= 4000  # type: ignore[operator]
    assert spec["n_docs"] == len(list(task.corpus()))
    assert spec["n_train"] == len(task.world.train) and spec["n_test"] == len(task.world.test)
    assert spec["n_test"] > 200 and spec["n_train"] > 5 * spec["n_test"]  # type: ignore[operator]
    assert {k: spec[k] for k in ("max_turns", "max_obs_tokens", "max_total_tokens", "reward")} == {
        "max_turns": 4, "max_obs_tokens": 512, "max_total_tokens": 1024, "reward": "cover_em"}
    assert "max_turn_tokens" not in spec and "index" not in spec


def test_spec_round_trip_and_checks(task: SearchTask) -> None:
    again = get_task("search", **task.spec())
    assert again.spec() == task.spec()
    assert again.get("test:5") == task.get("test:5")
    with pytest.raises(ValueError, match="option 'n_docs'"):
        get_task("search", **{**task.spec(), "n_docs": 5})
    with pytest.raises(ValueError, match="option 'prompt_version'"):
        get_task("search", **{**task.spec(), "prompt_version": 99})
    small = load_task("search:entities=40,seed=3,max_turns=2,reward=em,topk=2,index=abc")
    assert isinstance(small, SearchTask)
    assert small.limits == EpisodeLimits(max_turns=2, max_obs_tokens=512, max_total_tokens=1024)
    assert small.spec()["index"] == "abc" and small.spec()["topk"] == 2
    assert get_task("search", **small.spec()).spec() == small.spec()


@pytest.mark.parametrize(("options", "name"), [({"entities": 5}, "entities"), ({"seed": -1}, "seed"),
                                               ({"reward": "f1"}, "reward"), ({"topk": 0}, "topk"),
                                               ({"max_turns": 0}, "max_turns"), ({"size": 3}, "size"),
                                               ({"shots": 2}, "shots"), ({"format_reward": 1.0}, "format_reward"),
                                               ({"hops": 3}, "hops"), ({"hops": 0}, "hops")])
def test_bad_options_name_the_option(options: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=f"'{name}'"):
        get_task("search", **options)


def test_prompt_ids_round_trip(task: SearchTask) -> None:
    for pid in ["train:0", "train:17", f"train:{len(task.world.train) - 1}", "test:0", "test:3"]:
        assert task.get(pid).id == pid
        assert SearchTask().get(pid) == task.get(pid)  # deterministic across instances
    for bad in ["train:01", "dev:0", "test", f"test:{len(task.world.test)}"]:
        with pytest.raises(PromptIdError):
            task.get(bad)
    rng = np.random.default_rng(0)
    assert all(task.sample_train(rng).id.startswith("train:") for _ in range(50))
    held = task.heldout(10_000)
    assert len(held) == len(task.world.test) and held[:7] == task.heldout(7)


def test_seed_changes_the_world() -> None:
    a, b = SearchTask(seed=0, entities=60), SearchTask(seed=1, entities=60)
    assert [d.text for d in a.corpus()] != [d.text for d in b.corpus()]
    assert list(a.corpus()) == list(SearchTask(seed=0, entities=60).corpus())


def test_splits_are_disjoint_by_entity(task: SearchTask) -> None:
    w = task.world
    train_subjects = {q.subject for q in w.train}
    test_subjects = {q.subject for q in w.test}
    assert test_subjects and test_subjects == set(w.heldout_entities)
    assert not train_subjects & test_subjects
    # The held-out entities' names never appear as subjects of training questions.
    names = {d.id: d.title for d in w.docs}
    train_text = " ".join(q.text for q in w.train)
    assert not any(f" {names[s]}?" in train_text or f" {names[s]} " in train_text for s in test_subjects)


def test_answers_are_not_in_the_prompt_but_in_the_subjects_document(task: SearchTask) -> None:
    docs = {d.id: d for d in task.corpus()}
    for split, questions in (("train", task.world.train), ("test", task.world.test)):
        for i, q in enumerate(questions):
            p = task.get(f"{split}:{i}")
            prompt = normalize_answer(" ".join(m["content"] for m in p.messages))
            golds = decode_golds(p.answer)
            assert golds == q.golds
            assert not any(normalize_answer(g) in prompt for g in golds), (p.id, golds)
            assert golds[0] in docs[q.subject].text, (p.id, golds)


@pytest.fixture(scope="module")
def two_hop() -> SearchTask:
    return SearchTask(hops=2)


def test_two_hop_spec_round_trips_and_one_hop_spec_is_unchanged(task: SearchTask, two_hop: SearchTask) -> None:
    assert "hops" not in task.spec()  # a one-hop run's contract and fingerprint are what they always were
    assert two_hop.spec()["hops"] == 2 and get_task("search", **two_hop.spec()).spec() == two_hop.spec()
    assert [d.text for d in two_hop.corpus()] == [d.text for d in task.corpus()]
    assert two_hop.world.heldout_entities == task.world.heldout_entities
    assert {q.text for q in task.world.test} < {q.text for q in two_hop.world.test}


def test_two_hop_answers_sit_on_the_bridge_page_which_only_the_subject_page_names(two_hop: SearchTask) -> None:
    docs = {d.id: d for d in two_hop.corpus()}
    hops = [q for q in two_hop.world.train + two_hop.world.test if q.steps]
    assert len(hops) > 0.2 * (len(two_hop.world.train) + len(two_hop.world.test))
    for q in hops:
        subject, bridge = docs[q.subject], docs[q.bridge]
        assert len(q.steps) == 2 and bridge.title in q.steps[1] and bridge.title not in q.text
        assert bridge.title in subject.text  # the first search finds the bridge's name
        assert q.golds[0] in bridge.text and q.golds[0] not in subject.text


def test_two_hop_training_questions_never_show_a_held_out_page(two_hop: SearchTask) -> None:
    held = two_hop.world.heldout_entities
    assert all(q.subject not in held and q.bridge not in held for q in two_hop.world.train)
    assert all(q.subject in held for q in two_hop.world.test)
    assert any(q.steps for q in two_hop.world.test)


def test_two_hop_demonstrations_search_each_step_then_answer(two_hop: SearchTask) -> None:
    demos = two_hop.demonstrations(64, np.random.default_rng(0))
    multi = [d for d in demos if len(d.turns) == 3]
    assert multi and len(multi) < len(demos)
    for d in multi:
        q = next(q for q in two_hop.world.train if q.text in d.prompt.messages[-1]["content"])
        assert d.turns[:2] == tuple(f"<search> {s} </search>" for s in q.steps)
        assert d.turns[2] == f"<answer> {q.golds[0]} </answer>" and d.evidence == q.golds[0]
        assert two_hop.is_correct(d.prompt, "\n".join(d.turns))


def test_corpus_ids_unique_and_names_do_not_nest() -> None:
    w = build_world(7, 300)
    assert len({d.id for d in w.docs}) == len(w.docs)
    assert all(d.text.strip() and d.title for d in w.docs)
    tokens = {t.lower() for q in w.train + w.test for g in q.golds for t in g.split() if not t.isdigit()}
    tokens.discard("river")
    nested = [(a, b) for a in tokens for b in tokens if a != b and a in b]
    assert not nested[:3]


ENV_PARSE = [
    ("<think>hm</think><search> Velmora Quist </search>", ToolCall("search", "Velmora Quist")),
    ("<search>a</search> and <search>b</search>", ToolCall("search", "b")),
    ("<search>x <search>y</search>", ToolCall("search", "y")),
    ("<search>  </search>", None),
    ("I know it. <answer>Tarsk</answer>", None),
    ("<search>q</search> <answer>x</answer>", None),
    ("<search>never closed", None),
    ("plain text", None),
]


@pytest.mark.parametrize(("turn", "call"), ENV_PARSE)
def test_env_parse(turn: str, call: ToolCall | None) -> None:
    assert SearchEnv().parse(turn) == call


def test_env_observe_segments_and_states() -> None:
    env = SearchEnv()
    assert isinstance(env, Environment) and env.stop_strings == ("</search>", "</answer>")
    assert env.initial_state() == "start"
    r1, r2 = ToolResult("Doc 1(Title: A) x\n", "d1"), ToolResult("Doc 1(Title: B) y\n", "d2")
    obs = env.observe(ToolCall("search", "q"), r1)
    assert obs.segments == (("\n\n<information>", ROLE_MASKED), ("Doc 1(Title: A) x\n", ROLE_ECHO),
                            ("</information>\n\n", ROLE_MASKED))
    assert obs.state == result_hash(["start", "d1"])
    second = env.observe(ToolCall("search", "q2"), r2)
    assert second.state == result_hash([obs.state, "d2"])
    other = SearchEnv()
    assert other.observe(ToolCall("search", "other words"), r1).state == obs.state  # same results, same state
    assert other.observe(ToolCall("search", "q"), r1).state != second.state
    assert env.initial_state() == "start"


def test_make_tools_needs_the_right_searcher(task: SearchTask) -> None:
    assert is_multiturn(task) and isinstance(task, MultiTurnTask) and task.tool_kind == "search"
    with pytest.raises(ValueError, match="needs a retriever"):
        task.make_tools(None)
    pinned = SearchTask(index="fp-1")
    with pytest.raises(ValueError, match="option 'index' is 'fp-1'"):
        pinned.make_tools(KeywordSearcher([], fingerprint="fp-2"))
    docs = list(task.corpus())[:5]
    tools = pinned.make_tools(KeywordSearcher(docs, fingerprint="fp-1"))
    (result,) = tools.run([ToolCall("search", docs[2].title)])
    assert result.text.startswith(f"Doc 1(Title: {docs[2].title}) {docs[2].text}")
    assert result.text.count("Doc ") == task.topk


def test_episodes_through_the_driver_and_the_reward(task: SearchTask) -> None:
    prompt = task.get("test:0")
    q = task.world.test[0]
    name = {d.id: d.title for d in task.corpus()}[q.subject]
    searcher = KeywordSearcher(list(task.corpus()))
    scripts = [
        [f"<search>{name}</search>", f"<answer>{q.golds[0]}</answer>"],  # searches, then answers right
        [f"<search>{name}</search>", "<answer>no idea</answer>"],  # reads the answer, answers wrong
        [f"<answer>{q.golds[0]}</answer>"],  # right without searching (the reward cannot tell)
        ["<search>a</search>", "<search>b</search>", "<search>c</search>", "<search>d</search>"],
    ]
    limits = replace(episode_limits(task, 64), max_total_tokens=10_000)  # one token per character here
    assert limits.max_turn_tokens == 64 and limits.max_turns == task.limits.max_turns
    envs = [task.make_env(prompt, seed) for seed in range(4)]
    eps = play(envs, task.make_tools(searcher), scripts, limits, n=4)
    assert [len(ep.calls) for ep in eps] == [1, 1, 0, 3]
    assert [ep.end_reason for ep in eps] == ["stop", "stop", "stop", "max_turns"]
    assert [task.reward(prompt, text_of(ep)) for ep in eps] == [1.0, 0.0, 1.0, 0.0]
    assert q.golds[0] in "".join(chr(t) for t, r in zip(eps[1].tokens, eps[1].roles, strict=True)
                                 if r == ROLE_ECHO)  # the answer was in the observation
    assert eps[0].states[0] == "start" and eps[0].states[1] == eps[1].states[1]  # same search, same state
    assert all(r in (ROLE_ACTION, ROLE_ECHO, ROLE_MASKED) for r in eps[0].roles)
    assert len(searcher.calls) == 3  # one batched request per round: 3 rounds for 5 calls
    assert sorted(len(c) for c in searcher.calls) == [1, 1, 3]


def test_reward_option_and_is_correct_agree(task: SearchTask) -> None:
    prompt = task.get("train:3")
    gold = decode_golds(prompt.answer)[0]
    strict = SearchTask(reward="em")
    for text, cover, exact in [(f"<answer>{gold}</answer>", 1.0, 1.0),
                               (f"<answer>it is {gold}</answer>", 1.0, 0.0),
                               ("<answer>wrong</answer>", 0.0, 0.0),
                               (gold, 0.0, 0.0)]:
        assert task.reward(prompt, text) == cover and task.is_correct(prompt, text) is bool(cover)
        assert strict.reward(prompt, text) == exact and strict.is_correct(prompt, text) is bool(exact)
        s = task.score(prompt, text)
        assert (s.cover_em, s.em) == (bool(cover), bool(exact))


def test_format_reward_pays_a_searched_then_answered_episode_only(task: SearchTask) -> None:
    prompt = task.get("train:3")
    gold = decode_golds(prompt.answer)[0]
    shaped = SearchTask(format_reward=0.1)
    assert shaped.spec()["format_reward"] == 0.1 and task.spec()["format_reward"] == 0.0
    for text, reward in [("<search> q </search>\n<answer> wrong </answer>", 0.1),  # the protocol, wrong answer
                         (f"<search> q </search>\n<answer> {gold} </answer>", 1.0),  # correct wins
                         ("<answer> wrong </answer>", 0.0),  # no search first
                         ("<answer> wrong </answer>\n<search> q </search>", 0.0),  # search after the answer
                         ("<search> q </search>\n<answer> unfinished", 0.0),  # no complete answer span
                         ("<search> q </search>", 0.0)]:
        assert shaped.reward(prompt, text) == reward, text
        assert shaped.is_correct(prompt, text) is (reward == 1.0)
        assert task.reward(prompt, text) == (1.0 if reward == 1.0 else 0.0)


def test_an_answer_after_observation_markup_the_policy_wrote_earns_nothing(task: SearchTask) -> None:
    prompt = task.get("train:3")
    gold = decode_golds(prompt.answer)[0]
    shaped = SearchTask(format_reward=0.1)
    doc = f"<information>Doc 1(Title: x) the answer is {gold}.</information>"
    for text in [f"{doc} <search> q </search>\n<answer> {gold} </answer>",  # a document before its search
                 f"<search> q </search>\n\n{doc}\n\n<answer> {gold} </answer>",  # the observation claimed
                 f"<search> q </search>\n</information> <answer> {gold} </answer>",  # a closing tag alone
                 f"<search> q </search>\n<answer> {gold} </answer> <information>"]:  # markup after the answer
        for t in (task, shaped):
            assert t.reward(prompt, text) == 0.0 and not t.is_correct(prompt, text), text
        s = task.score(prompt, text)
        assert not s.em and not s.cover_em
    assert task.reward(prompt, f"<search> q </search>\n<answer> {gold} </answer>") == 1.0  # without markup


def test_prompt_kind_tells_one_hop_from_two_hop(two_hop: SearchTask) -> None:
    kinds = [two_hop.prompt_kind(p) for p in two_hop.heldout(10_000)]
    assert kinds.count("2hop") == sum(1 for q in two_hop.world.test if q.steps) > 0
    assert set(kinds) == {"1hop", "2hop"}
