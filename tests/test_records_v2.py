"""Records schema version 2: roles, turns, tool calls and end reasons round-trip; version 1 still decodes;
validation rejects inconsistent roles (``roles``) and episodes over the task's limits (``limits``)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import xxhash

from stoa.contract import ModelSpec, SamplingSpec
from stoa.rollouts.episode import EpisodeLimits, ToolCall
from stoa.rollouts.records import (
    MAX_ARGUMENT_CHARS,
    MAX_TURNS,
    RECORD_MAGIC,
    RECORD_SCHEMA_VERSION,
    REJECT_REASONS,
    RecordRejected,
    RolloutRecord,
    Sample,
    validate_record,
)
from tests.envs.fakes import CharCodec, honest_sample
from tests.test_records import make_contract, make_record

LIMITS = EpisodeLimits(max_turns=3, max_turn_tokens=40, max_obs_tokens=60, max_total_tokens=200)
TURNS = ["<search>capital of x</search>", "<answer>X city</answer>"]


def multi_record(contract=None, **kw):
    """A two-sample multi-turn record over a char-level vocabulary (ids < 128)."""
    contract = contract or _contract()
    samples = [honest_sample(TURNS, CharCodec(), seed=5), honest_sample(TURNS[1:], CharCodec(), seed=5)]
    base = dict(contract_fingerprint=contract.fingerprint(), samples=samples, env_seed=5)
    base.update(kw)
    return contract, make_record(contract, **base)


def _contract(max_new_tokens: int = 8):
    return make_contract(model=ModelSpec("llama", "c" * 32, "t" * 32, vocab_size=128, eos_token_ids=(2,)),
                         sampling=SamplingSpec(1.0, 1.0, max_new_tokens))


def test_multi_turn_round_trip_is_exact():
    contract, rec = multi_record()
    back = RolloutRecord.decode(rec.encode())
    assert back.schema_version == RECORD_SCHEMA_VERSION == 2 and back.env_seed == 5
    for a, b in zip(back.samples, rec.samples, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        np.testing.assert_array_equal(a.roles, b.roles)
        assert a.roles is not None and a.roles.dtype == np.uint8
        assert (a.turn_starts, a.calls, a.digests, a.end_reason) == (b.turn_starts, b.calls, b.digests, b.end_reason)
    assert back.samples[0].calls == [ToolCall("search", "capital of x")] and back.samples[0].turn_starts[0] == 0
    validate_record(back, contract, current_version=1, limits=LIMITS)
    assert back.content_id() == rec.content_id()


def test_single_turn_samples_are_written_with_action_roles():
    c = make_contract()
    rec = make_record(c)
    back = RolloutRecord.decode(rec.encode())
    assert back.schema_version == 2
    assert [s.roles.tolist() for s in back.samples] == [[1, 1, 1], [1]]
    assert all(s.turn_starts == [] and s.calls == [] and s.end_reason == "" for s in back.samples)
    validate_record(back, c, current_version=1)
    assert back.content_id() == rec.content_id()


def encode_v1(rec: RolloutRecord) -> bytes:
    """The version-1 layout, written by hand: header without turns/calls/end/env_seed; tokens and logprobs."""
    header = {"worker_id": rec.worker_id, "seq": rec.seq, "policy_version": rec.policy_version,
              "contract_fingerprint": rec.contract_fingerprint, "task_id": rec.task_id, "prompt_id": rec.prompt_id,
              "prompt_len": int(rec.prompt_tokens.size),
              "samples": [{"len": int(s.tokens.size), "reward": s.reward, "finish": s.finish_reason}
                          for s in rec.samples],
              "sampling": {}, "timings": {"generate_s": 0.5}, "created_at": 0.0}
    hb = json.dumps(header, separators=(",", ":")).encode()
    parts = [struct.pack("<8sHHI", RECORD_MAGIC, 1, 0, len(hb)), hb, rec.prompt_tokens.astype("<i4").tobytes()]
    for s in rec.samples:
        parts += [s.tokens.astype("<i4").tobytes(), s.logprobs.astype("<f4").tobytes()]
    body = b"".join(parts)
    return body + xxhash.xxh3_128_digest(body)


def test_version_1_records_still_decode_and_validate():
    c = make_contract()
    rec = make_record(c)
    back = RolloutRecord.decode(encode_v1(rec))
    assert back.schema_version == 1 and back.env_seed == 0 and back.timings == {"generate_s": 0.5}
    assert all(s.roles is None and s.calls == [] and s.end_reason == "" for s in back.samples)
    np.testing.assert_array_equal(back.samples[0].tokens, [5, 6, 2])
    np.testing.assert_array_equal(back.samples[0].role_array(), [1, 1, 1])
    validate_record(back, c, current_version=1)
    # The same content in either layout is one record for the reuse cap.
    assert back.content_id() == RolloutRecord.decode(rec.encode()).content_id()
    # A version-1 record is never a multi-turn episode (it has no end reason).
    with pytest.raises(RecordRejected) as e:
        validate_record(back, c, current_version=1, limits=LIMITS)
    assert e.value.reason == "roles"


def test_content_id_hashes_roles():
    _, rec = multi_record()
    other = RolloutRecord.decode(rec.encode())
    other.samples[0].roles = other.samples[0].roles.copy()
    other.samples[0].roles[other.samples[0].roles == 2] = 0
    assert other.content_id() != rec.content_id()


def test_reasons_are_registered():
    assert {"roles", "limits", "observation"} <= set(REJECT_REASONS)


def _set(attr, value):
    return lambda s: setattr(s, attr, value)


def _roles_edit(fn):
    def edit(s):
        s.roles = s.roles.copy()
        fn(s)
    return edit


def _obs_index(s):
    return int(np.flatnonzero(s.roles != 1)[0])


def _leading_observation(s):
    """An observation run before the first turn, declared consistently (turn starts, one call per run)."""
    s.tokens = np.concatenate([np.array([60, 61], np.int32), s.tokens])
    s.logprobs = np.concatenate([np.zeros(2, np.float32), s.logprobs])
    s.roles = np.concatenate([np.array([0, 2], np.uint8), s.roles])
    s.turn_starts = [t + 2 for t in s.turn_starts]
    s.calls = [ToolCall("search", "x")] + s.calls
    s.digests = ["d"] + s.digests


@pytest.mark.parametrize("edit,reason", [
    (_roles_edit(lambda s: setattr(s, "roles", s.roles[:-1])), "roles"),
    (_roles_edit(lambda s: s.roles.__setitem__(_obs_index(s), 3)), "roles"),
    (_roles_edit(lambda s: s.roles.__setitem__(0, 0)), "roles"),  # first token not an action (logprob too)
    (_leading_observation, "roles"),
    (lambda s: s.logprobs.__setitem__(_obs_index(s), -0.5), "roles"),  # a logprob on an observation token
    (_set("turn_starts", [0, 5]), "roles"),
    (_set("turn_starts", [0]), "roles"),
    (lambda s: s.calls.append(ToolCall("search", "again")), "roles"),
    (lambda s: s.digests.pop(), "roles"),
    (_set("end_reason", "bogus"), "roles"),
    (_set("end_reason", "length"), "finish_reason"),  # finish says stop
    (lambda s: s.logprobs.__setitem__(0, np.nan), "nonfinite"),
])
def test_multi_turn_inconsistencies_are_rejected(edit, reason):
    contract, rec = multi_record()
    edit(rec.samples[0])
    with pytest.raises(RecordRejected) as e:
        validate_record(rec, contract, current_version=1, limits=LIMITS)
    assert e.value.reason == reason, e.value


@pytest.mark.parametrize("limits,needle", [
    (EpisodeLimits(max_turns=1, max_turn_tokens=40, max_obs_tokens=60, max_total_tokens=200), "max_turns"),
    (EpisodeLimits(max_turns=3, max_turn_tokens=20, max_obs_tokens=60, max_total_tokens=200), "max_turn_tokens"),
    (EpisodeLimits(max_turns=3, max_turn_tokens=40, max_obs_tokens=30, max_total_tokens=200), "max_obs_tokens"),
    (EpisodeLimits(max_turns=3, max_turn_tokens=40, max_obs_tokens=60, max_total_tokens=80), "max_total_tokens"),
])
def test_episodes_over_the_limits_are_rejected(limits, needle):
    contract, rec = multi_record()
    with pytest.raises(RecordRejected) as e:
        validate_record(rec, contract, current_version=1, limits=limits)
    assert e.value.reason == "limits" and needle in str(e.value)


def test_single_turn_task_refuses_observation_tokens():
    contract, rec = multi_record(_contract(max_new_tokens=500))  # long enough to reach the roles check
    with pytest.raises(RecordRejected) as e:
        validate_record(rec, contract, current_version=1)
    assert e.value.reason == "roles"
    c = make_contract()
    plain = make_record(c)
    plain.samples[0].roles = np.array([1, 1, 0], np.uint8)  # no calls, but a token that was not sampled
    plain.samples[0].logprobs[2] = 0.0
    with pytest.raises(RecordRejected) as e:
        validate_record(plain, c, current_version=1)
    assert e.value.reason == "roles"
    rec.samples = [rec.samples[1], rec.samples[1]]  # one action turn, no calls, an end reason: fine
    validate_record(rec, contract, current_version=1)


def _reframed(edit) -> bytes:
    """A multi-turn record with its JSON header edited and the digest recomputed (a 'valid' liar)."""
    data = multi_record()[1].encode()
    body = data[:-16]
    _, schema, res, hlen = struct.unpack_from("<8sHHI", body)
    header = json.loads(body[16 : 16 + hlen])
    edit(header)
    hb = json.dumps(header).encode()
    body2 = struct.pack("<8sHHI", RECORD_MAGIC, schema, res, len(hb)) + hb + body[16 + hlen :]
    return body2 + xxhash.xxh3_128_digest(body2)


@pytest.mark.parametrize("edit", [
    lambda h: h["samples"][0].__setitem__("calls", [["search", "q", "d"]] * (MAX_TURNS + 1)),
    lambda h: h["samples"][0].__setitem__("calls", [["search", "q" * (MAX_ARGUMENT_CHARS + 1), "d"]]),
    lambda h: h["samples"][0].__setitem__("calls", [["search", "q", "d" * 65]]),
    lambda h: h["samples"][0].__setitem__("calls", [["search", "q"]]),
    lambda h: h["samples"][0].__setitem__("calls", [["search", 3, "d"]]),
    lambda h: h["samples"][0].__setitem__("calls", {"a": 1}),
    lambda h: h["samples"][0].__setitem__("turns", [0, True]),
    lambda h: h["samples"][0].__setitem__("turns", [0, -1]),
    lambda h: h["samples"][0].__setitem__("turns", list(range(MAX_TURNS + 1))),
    lambda h: h["samples"][0].pop("turns"),
    lambda h: h["samples"][0].pop("end"),
    lambda h: h["samples"][0].__setitem__("end", "x" * 33),
    lambda h: h.pop("env_seed"),
    lambda h: h.__setitem__("env_seed", -1),
    lambda h: h["samples"][0].__setitem__("calls", [[["deep"]]]),
])
def test_bad_v2_headers_are_malformed(edit):
    with pytest.raises(RecordRejected) as e:
        RolloutRecord.decode(_reframed(edit))
    assert e.value.reason == "malformed"


def test_payload_sizes_follow_the_version():
    rec = make_record(make_contract())
    v1 = encode_v1(rec)[:-16] + b"\x01\x01\x01\x01"  # version-1 sizes plus role bytes: surplus
    with pytest.raises(RecordRejected) as e:
        RolloutRecord.decode(v1 + xxhash.xxh3_128_digest(v1))
    assert e.value.reason == "length_mismatch"
    v2 = rec.encode()[:-16][:-4]  # the last sample's role byte and 3 logprob bytes cut
    with pytest.raises(RecordRejected) as e:
        RolloutRecord.decode(v2 + xxhash.xxh3_128_digest(v2))
    assert e.value.reason == "length_mismatch"
    body = bytearray(multi_record()[1].encode()[:-16])
    struct.pack_into("<H", body, 8, 1)  # a version-2 header under a version-1 prefix: too deep for v1
    with pytest.raises(RecordRejected) as e:
        RolloutRecord.decode(bytes(body) + xxhash.xxh3_128_digest(bytes(body)))
    assert e.value.reason == "malformed"


def test_unknown_schema_is_rejected():
    data = multi_record()[1].encode()
    body = bytearray(data[:-16])
    struct.pack_into("<H", body, 8, 4)  # 3 is version 2 signed (stoa.identity)
    with pytest.raises(RecordRejected) as e:
        RolloutRecord.decode(bytes(body) + xxhash.xxh3_128_digest(bytes(body)))
    assert e.value.reason == "schema"


def test_sample_defaults_keep_single_turn_code_working():
    s = Sample(np.array([1, 2], np.int32), np.array([-1.0, -1.0], np.float32), 0.0, "stop")
    assert s.roles is None and s.turn_starts == [] and s.calls == [] and s.digests == [] and s.end_reason == ""
