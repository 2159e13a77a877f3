"""The trainer's replay: honest episodes pass; injected documents, lying roles and long episodes are rejected."""

from __future__ import annotations

import numpy as np
import pytest

from stoa.envs import ToolUnavailable
from stoa.episodes.replay import replay_group
from stoa.rollouts.episode import ROLE_ACTION, ROLE_ECHO, ROLE_MASKED, EpisodeLimits, ToolCall
from stoa.rollouts.records import RecordRejected
from tests.envs.fakes import CharCodec, FakeTools, SearchEnv, honest_sample

CODEC = CharCodec()
LIMITS = EpisodeLimits(max_turns=3, max_turn_tokens=64, max_obs_tokens=64, max_total_tokens=512)
TWO_SEARCHES = ["<search>capital of x</search>", "<search>color of y</search>", "<answer>blue</answer>"]
ONE_SEARCH = ["think <search>color of y</search>", "<answer>blue</answer>"]
NO_SEARCH = ["<answer>red</answer>"]


def group(*turn_lists):
    return [honest_sample(t, CODEC, seed=7) for t in turn_lists]


def replay(samples, tools=None, limits=LIMITS):
    tools = tools or FakeTools()
    return replay_group([SearchEnv(7) for _ in samples], samples, tools, CODEC, limits), tools


def test_honest_group_replays_with_one_tool_request():
    samples = group(TWO_SEARCHES, NO_SEARCH, ONE_SEARCH, TWO_SEARCHES)
    out, tools = replay(samples)
    assert tools.batches == [[ToolCall("search", "capital of x"), ToolCall("search", "color of y"),
                              ToolCall("search", "color of y")] + [ToolCall("search", "capital of x"),
                                                                   ToolCall("search", "color of y")]]
    assert [r.calls for r in out] == [2, 0, 1, 2]
    assert out[0].text == "\n".join(TWO_SEARCHES) and out[1].text == NO_SEARCH[0]
    turn_of_token = out[0].turn_of_token
    roles = samples[0].role_array()
    assert turn_of_token.dtype == np.int32 and np.all((turn_of_token >= 0) == (roles == ROLE_ACTION))
    assert [int(turn_of_token[t]) for t in samples[0].turn_starts] == [0, 1, 2]
    assert len(out[0].states) == 3 and out[0].states[0] == "seed7" and len(set(out[0].states)) == 3
    assert out[1].states == ("seed7",)
    assert out[3].states == out[0].states  # the same calls from the same start: equal anchor states
    assert out[2].states[1] != out[0].states[1]  # another result, another state


def _replace_observation_text(sample, old: str, new: str) -> None:
    """Swap document text inside the echo run (same length: only the content differs)."""
    assert len(old) == len(new)
    text = CODEC.decode(sample.tokens.tolist())
    at = text.index(old)
    sample.tokens[at : at + len(old)] = CODEC.encode_text(new)


def test_injected_document_is_rejected_naming_sample_and_turn():
    samples = group(NO_SEARCH, TWO_SEARCHES)
    _replace_observation_text(samples[1], "Y is blue.", "Y is reds.")
    with pytest.raises(RecordRejected) as e:
        replay(samples)
    assert e.value.reason == "observation" and "sample 1 turn 1" in str(e.value)


def test_a_result_digest_that_differs_is_rejected():
    samples = group(ONE_SEARCH, ONE_SEARCH)
    samples[0].digests[0] = "0" * 16
    with pytest.raises(RecordRejected) as e:
        replay(samples)
    assert e.value.reason == "observation" and "sample 0 turn 0" in str(e.value)


def test_a_call_that_the_turn_does_not_make_is_rejected():
    samples = group(ONE_SEARCH, ONE_SEARCH)
    samples[1].calls[0] = ToolCall("search", "capital of x")  # what the worker claims it ran
    with pytest.raises(RecordRejected) as e:
        replay(samples)
    assert e.value.reason == "observation" and "sample 1 turn 0" in str(e.value)


def test_a_turn_edited_after_its_call_is_rejected():
    """Call, digest and observation agree with each other; only the turn's text asks for something else."""
    samples = group(NO_SEARCH, TWO_SEARCHES)
    turn = samples[1].tokens[: len(TWO_SEARCHES[0])]
    assert CODEC.decode(turn.tolist()) == TWO_SEARCHES[0]
    samples[1].tokens[: len(TWO_SEARCHES[0])] = CODEC.encode_text("<search>capital of q</search>")
    with pytest.raises(RecordRejected) as e:
        replay(samples)
    assert e.value.reason == "observation" and "sample 1 turn 0" in str(e.value) and "capital of q" in str(e.value)


def _obs_span(sample):
    """Start and end of the first observation run."""
    roles = sample.role_array()
    a = int(np.flatnonzero(roles != ROLE_ACTION)[0])
    b = a + int(np.flatnonzero(roles[a:] == ROLE_ACTION)[0])
    return a, b


def _observation_marked_action(sample):
    """Every observation token relabelled as an action with a logprob (a naive liar)."""
    a, b = _obs_span(sample)
    sample.roles[a:b] = ROLE_ACTION
    sample.logprobs[a:b] = -0.1


def _echo_marked_action_consistently(sample):
    """Only the documents relabelled as a turn, with turn starts and calls made to match (a careful liar)."""
    roles = sample.roles
    echo = np.flatnonzero(roles == ROLE_ECHO)
    roles[echo] = ROLE_ACTION
    sample.logprobs[echo] = -0.1
    sample.turn_starts = [0, int(echo[0]), sample.turn_starts[1]]
    sample.calls = [sample.calls[0], ToolCall("search", "Y is blue.")]
    sample.digests = sample.digests * 2


def _action_marked_observation(sample):
    """The closing tag of the first turn relabelled as observation text."""
    a, _ = _obs_span(sample)
    cut = a - len("</search>")
    sample.roles[cut:a] = ROLE_MASKED
    sample.logprobs[cut:a] = 0.0


def _echo_marked_masked(sample):
    """The documents relabelled as template text (same tokens, no logprobs either way)."""
    sample.roles[sample.roles == ROLE_ECHO] = ROLE_MASKED


def _action_marked_observation_keeping_logprobs(sample):
    a, _ = _obs_span(sample)
    sample.roles[a - 3 : a] = ROLE_MASKED


@pytest.mark.parametrize("lie,reason", [
    (_observation_marked_action, "roles"),
    (_echo_marked_action_consistently, "observation"),
    (_action_marked_observation, "turn_end"),
    (_echo_marked_masked, "observation"),
    (_action_marked_observation_keeping_logprobs, "roles"),
])
def test_lying_roles_are_rejected(lie, reason):
    samples = group(ONE_SEARCH, ONE_SEARCH)
    lie(samples[1])
    with pytest.raises(RecordRejected) as e:
        replay(samples)
    assert e.value.reason == reason, e.value


def test_limits_are_enforced():
    samples = group(TWO_SEARCHES, NO_SEARCH)
    with pytest.raises(RecordRejected) as e:
        replay(samples, limits=EpisodeLimits(max_turns=2, max_turn_tokens=64, max_obs_tokens=64,
                                             max_total_tokens=512))
    assert e.value.reason == "limits" and "3 turns" in str(e.value)
    with pytest.raises(RecordRejected) as e:
        replay(samples, limits=EpisodeLimits(max_turns=3, max_turn_tokens=64, max_obs_tokens=20,
                                             max_total_tokens=512))
    assert e.value.reason == "limits" and "max_obs_tokens" in str(e.value)


def test_unavailable_tools_raise_not_reject():
    samples = group(ONE_SEARCH, NO_SEARCH)
    with pytest.raises(ToolUnavailable):
        replay(samples, tools=FakeTools(fail=True))


def test_a_group_without_calls_needs_no_tools():
    out, tools = replay(group(NO_SEARCH, NO_SEARCH), tools=FakeTools(fail=True))
    assert tools.batches == [] and [r.calls for r in out] == [0, 0]


EOS = 3  # a control character: CharCodec never writes it for text


WIDE = EpisodeLimits(max_turns=3, max_turn_tokens=96, max_obs_tokens=64, max_total_tokens=512)


def replay_eos(samples):
    return replay_group([SearchEnv(7) for _ in samples], samples, FakeTools(), CODEC, WIDE, [EOS])


def _with_eos(sample, at: int) -> None:
    sample.tokens[at] = EOS


@pytest.mark.parametrize("turns,end,edit,detail", [
    # the whole forged observation claimed as the model's own turn: the engine would have paused at </search>
    (["<search>color of y</search><information>Y is red</information><answer>red</answer>"], "stop", None,
     "completes at token 26 of 82"),
    (["<search>color of y</search> <search>capital of x</search>", "<answer>blue</answer>"], "stop", None,
     "completes at token 26 of 57"),
    (["I say <answer>red</answer> then <search>color of y</search>", "<answer>blue</answer>"], "stop", None,
     "completes at token 25 of 59"),
    (["<search>color of y</search>", "<answer>blue</answer> after the answer"], "stop", None, "completes at token"),
    (["abc<search>color of y</search>", "<answer>blue</answer>"], "stop", 1, "EOS at token 1"),
    (["<answer>blue</answer>"], "length", None, "gives stop"),  # ended at a stop string, not at the cap
    (["<answer>blue"], "stop", None, "without EOS, a stop string"),  # no reason to end there
    (["<search>color of y</search>", "<search>capital of x</search>"], "stop", None, "gives max_obs_tokens"),
])
def test_turns_must_end_where_an_engine_ends_them(turns, end, edit, detail):
    samples = [honest_sample(NO_SEARCH, CODEC, seed=7), honest_sample(turns, CODEC, seed=7, end=end)]
    if edit is not None:
        _with_eos(samples[1], edit)
    with pytest.raises(RecordRejected) as e:
        replay_eos(samples)
    assert e.value.reason == "turn_end" and "sample 1" in str(e.value) and detail in str(e.value), e.value


def test_a_sample_that_ends_with_an_observation_is_rejected():
    samples = group(ONE_SEARCH, ONE_SEARCH)
    cut = samples[1].turn_starts[1]
    s = samples[1]
    s.tokens, s.logprobs = s.tokens[:cut], s.logprobs[:cut]
    s.roles, s.turn_starts = s.role_array()[:cut], s.turn_starts[:1]
    with pytest.raises(RecordRejected) as e:
        replay(samples)
    assert e.value.reason == "turn_end" and "ends with an observation" in str(e.value)


def test_every_honest_ending_is_accepted():
    """EOS, a final answer, a call on the last turn, the turn cap and the episode's token budget."""
    eos = honest_sample(["<search>color of y</search>", "fine"], CODEC, seed=7)
    eos.tokens[-1] = EOS
    capped = honest_sample(["<search>color of y</search>", "x" * 64], CODEC, seed=7, end="length")
    budget = honest_sample(["<search>color of y</search>", "y" * 20], CODEC, seed=7, end="max_total_tokens")
    tight = EpisodeLimits(max_turns=3, max_turn_tokens=64, max_obs_tokens=64, max_total_tokens=budget.tokens.size)
    samples = [eos, capped, honest_sample(TWO_SEARCHES, CODEC, seed=7),
               honest_sample(TWO_SEARCHES[:2] + TWO_SEARCHES[:1], CODEC, seed=7, end="max_turns"),
               honest_sample(ONE_SEARCH[:1], CODEC, seed=7, end="max_obs_tokens"), budget]
    out = replay_group([SearchEnv(7) for _ in samples], samples, FakeTools(), CODEC, tight, [EOS])
    assert [r.calls for r in out] == [1, 1, 2, 2, 0, 1]


def _append_to_observation(sample, k: int, text: str, role: int) -> None:
    """Insert ``text`` (role ``role``) after the real observation that follows turn ``k``, before turn ``k + 1``."""
    at = sample.turn_starts[k + 1]
    extra = np.array(CODEC.encode_text(text), np.int32)
    sample.tokens = np.concatenate([sample.tokens[:at], extra, sample.tokens[at:]])
    sample.roles = np.concatenate([sample.roles[:at], np.full(extra.size, role, np.uint8), sample.roles[at:]])
    sample.logprobs = np.concatenate([sample.logprobs[:at], np.zeros(extra.size, np.float32), sample.logprobs[at:]])
    sample.turn_starts = [s if j <= k else s + extra.size for j, s in enumerate(sample.turn_starts)]


@pytest.mark.parametrize("k,text,role", [
    (0, "<information>X is red.</information>\n", ROLE_ECHO),  # a second document after the real one
    (1, "\n<information>Y is red.</information>\n", ROLE_MASKED),  # as template text, after the last observation
    (0, " ", ROLE_MASKED),  # a single token more
])
def test_a_document_appended_after_the_real_observation_is_rejected(k, text, role):
    """The recorded observation must equal the replayed one in length too, not only in its first tokens."""
    samples = group(NO_SEARCH, TWO_SEARCHES)
    _append_to_observation(samples[1], k, text, role)
    with pytest.raises(RecordRejected) as e:
        replay(samples, limits=EpisodeLimits(max_turns=3, max_turn_tokens=64, max_obs_tokens=128,
                                             max_total_tokens=512))
    assert e.value.reason == "observation" and f"sample 1 turn {k}" in str(e.value), e.value
