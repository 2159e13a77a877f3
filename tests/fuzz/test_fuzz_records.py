"""Record intake is a total function: decode + validate + key parsing over generated and mutated input.

Every input either decodes and validates, or raises ``RecordRejected`` with a known reason; nothing
else may escape (no RecursionError, OverflowError, struct.error, IndexError, MemoryError...).
Mutations are re-sealed with a fresh digest, so they reach the header parser and the validator
instead of stopping at the digest check. The fast tier runs >= 10,000 inputs in a few seconds; the
``slow`` tier runs ten times more.
"""

from __future__ import annotations

import json
import random
import struct
from collections import Counter

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoa.contract import ModelSpec, RunContract, SamplingSpec
from stoa.layout import parse_rollout_key, rollout_key
from stoa.rollouts.episode import END_REASONS, EpisodeLimits, ToolCall
from stoa.rollouts.records import RECORD_MAGIC, REJECT_REASONS, RecordRejected, RolloutRecord, Sample, validate_record

CONTRACT = RunContract(run_id="r1", model=ModelSpec("llama", "c" * 32, "t" * 32, vocab_size=100, eos_token_ids=(2,)),
                       n_samples=3, plane="bf16", task_id="arithmetic", task_spec={"digits": 2},
                       reward_version="1", sampling=SamplingSpec(1.0, 1.0, 8))
PREFIX = struct.Struct("<8sHHI")
LIMITS = EpisodeLimits(max_turns=3, max_turn_tokens=8, max_obs_tokens=6, max_total_tokens=40)


def episode_sample(rng: random.Random) -> Sample:
    """A valid multi-turn sample: action runs separated by observation runs, one call per observation."""
    tokens: list[int] = []
    roles: list[int] = []
    starts: list[int] = []
    turns = rng.randint(1, 4)  # one past LIMITS.max_turns now and then, and runs past their limits too
    for k in range(turns):
        starts.append(len(tokens))
        n = rng.randint(1, 8)
        tokens += [rng.randrange(100) for _ in range(n)]
        roles += [1] * n
        if k < turns - 1:
            m = rng.randint(1, 7)
            tokens += [rng.randrange(100) for _ in range(m)]
            roles += [rng.choice([0, 2]) for _ in range(m)]
    r = np.array(roles, np.uint8)
    end = rng.choice(END_REASONS)
    return Sample(np.array(tokens, np.int32), np.where(r == 1, -rng.random() * 5, 0.0).astype(np.float32),
                  float(rng.random() < 0.5), "length" if end == "length" else "stop", roles=r, turn_starts=starts,
                  calls=[ToolCall("search", f"q{rng.randrange(99)}") for _ in range(turns - 1)],
                  digests=[f"{rng.getrandbits(64):016x}" for _ in range(turns - 1)], end_reason=end)


def valid_record(rng: random.Random) -> RolloutRecord:
    samples = []
    multi = rng.random() < 0.5
    for _ in range(CONTRACT.n_samples):
        if multi:
            samples.append(episode_sample(rng))
            continue
        n = rng.randint(1, 8)
        samples.append(Sample(np.array([rng.randrange(100) for _ in range(n)], np.int32),
                              np.array([-rng.random() * 5 for _ in range(n)], np.float32),
                              float(rng.random() < 0.5), rng.choice(["stop", "length"])))
    return RolloutRecord(worker_id=f"w{rng.randrange(99)}", seq=rng.randrange(1000), policy_version=rng.randint(1, 9),
                         contract_fingerprint=CONTRACT.fingerprint(), task_id="arithmetic",
                         prompt_id=f"train:{rng.randrange(1000)}",
                         prompt_tokens=np.array([rng.randrange(100) for _ in range(rng.randint(1, 12))], np.int32),
                         samples=samples, timings={"generate_s": rng.random()}, created_at=1.7e9,
                         env_seed=rng.randrange(2**32) if multi else 0)


def seal(body: bytes) -> bytes:
    return body + xxhash.xxh3_128_digest(body)


def split(data: bytes) -> tuple[dict, bytes]:
    body = data[:-16]
    hlen = PREFIX.unpack_from(body)[3]
    return json.loads(body[PREFIX.size : PREFIX.size + hlen]), body[PREFIX.size + hlen :]


def join(header_text: bytes, payload: bytes, schema: int = 2) -> bytes:
    return seal(PREFIX.pack(RECORD_MAGIC, schema, 0, len(header_text)) + header_text + payload)


HOSTILE_VALUES = ["1" + "0" * 400, "-1", "1e999", "-1e999", "NaN", "Infinity", "true", "null", '""', '"x"',
                  "[]", "{}", "[" * 3000 + "]" * 3000, '{"a":' * 500 + "1" + "}" * 500, "0.5", "2147483648",
                  "9" * 30, '"' + "A" * 5000 + '"', '"\\ud800"', "-0", "1e-400"]


def mutate_header(rng: random.Random, data: bytes) -> bytes:
    try:
        header, payload = split(data)
        assert isinstance(header, dict) and isinstance(header.get("samples"), list) and header["samples"]
        assert all(isinstance(m, dict) for m in header["samples"])
    except (ValueError, AssertionError, struct.error, RecursionError):  # an earlier mutation broke it
        return mutate_bytes(rng, data)
    target = header if rng.random() < 0.6 else rng.choice(header["samples"])
    calls = target.get("calls")
    if isinstance(calls, list) and calls and isinstance(calls[0], list) and rng.random() < 0.3:
        call = rng.choice(calls)  # a [name, arguments, digest] entry: edit one of its three slots
        slot = rng.randrange(len(call) + 1)
        call[slot:slot + 1] = ["\u0001MARK\u0001"]
        text = json.dumps(header, separators=(",", ":")).replace(json.dumps("\u0001MARK\u0001"),
                                                                 rng.choice(HOSTILE_VALUES))
        return join(text.encode(), payload)
    name = rng.choice(sorted(target) + ["extra"])
    text = json.dumps(header, separators=(",", ":"))
    marker = "\u0001MARK\u0001"
    if rng.random() < 0.15:
        target.pop(name, None)
        return join(json.dumps(header).encode(), payload)
    target[name] = marker
    text = json.dumps(header, separators=(",", ":")).replace(json.dumps(marker), rng.choice(HOSTILE_VALUES))
    return join(text.encode(), payload)


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    body = bytearray(data[:-16])
    kind = rng.randrange(5)
    if kind == 0:  # bit flips anywhere, re-sealed
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(body))
            body[i] ^= 1 << rng.randrange(8)
        return seal(bytes(body))
    if kind == 1:  # truncation, sealed or not
        cut = bytes(body[: rng.randrange(len(body))])
        return seal(cut) if rng.random() < 0.5 else cut
    if kind == 2:  # header length field lies
        struct.pack_into("<I", body, 12, rng.choice([0, 1, len(body), 2**32 - 1, rng.randrange(2**32)]))
        return seal(bytes(body))
    if kind == 3:  # payload grows or shrinks
        extra = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        return seal(bytes(body) + extra if rng.random() < 0.5 else bytes(body[: -rng.randint(1, 8)]))
    return bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))  # noise


def check_total(data: bytes, outcomes: Counter) -> None:
    """Decode and validate (as a single-turn and as a multi-turn task); only RecordRejected with a known
    reason may escape."""
    try:
        rec = RolloutRecord.decode(data)
        rec.content_id()
    except RecordRejected as e:
        assert e.reason in REJECT_REASONS, e.reason
        outcomes[e.reason] += 1
        return
    for limits in (None, LIMITS):
        try:
            validate_record(rec, CONTRACT, current_version=10, limits=limits)
            outcomes["valid" if limits is None else "valid_multiturn"] += 1
        except RecordRejected as e:
            assert e.reason in REJECT_REASONS, e.reason
            outcomes[e.reason] += 1


def run_mutations(count: int, seed: int) -> Counter:
    rng = random.Random(seed)
    outcomes: Counter = Counter()
    for i in range(count):
        data = valid_record(rng).encode()
        for _ in range(rng.randint(1, 3)):
            data = mutate_header(rng, data) if rng.random() < 0.5 and i % 7 else mutate_bytes(rng, data)
            if len(data) <= 16 + PREFIX.size:
                break
        check_total(data, outcomes)
    return outcomes


def test_ten_thousand_mutated_records_are_all_accepted_or_rejected_with_a_reason() -> None:
    outcomes = run_mutations(10_000, seed=1)
    assert sum(outcomes.values()) >= 10_000
    # The mutations reach past the digest: the header parser and the validator both see many inputs.
    assert outcomes["malformed"] > 1000 and outcomes["length_mismatch"] > 100, outcomes
    assert outcomes["roles"] > 100 and outcomes["limits"] > 10 and outcomes["valid_multiturn"] > 10, outcomes
    print("mutated record outcomes:", dict(outcomes))


@pytest.mark.slow
def test_a_hundred_thousand_mutated_records() -> None:
    outcomes = run_mutations(100_000, seed=2)
    assert sum(outcomes.values()) >= 100_000
    print("mutated record outcomes:", dict(outcomes))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["worker_id", "seq", "policy_version", "contract_fingerprint", "task_id",
                                        "prompt_id", "prompt_len", "samples", "sampling", "timings", "created_at",
                                        "env_seed", "junk"]), json_values, max_size=13),
       st.binary(max_size=64), st.sampled_from([1, 2]))
def test_generated_headers_never_escape(header: dict, payload: bytes, schema: int) -> None:
    check_total(join(json.dumps(header).encode(), payload, schema), Counter())


sample_headers = st.fixed_dictionaries(
    {"len": st.integers(0, 6), "reward": st.floats(allow_nan=False) | st.integers(), "finish": st.text(max_size=8)},
    optional={"turns": st.lists(st.integers(-2, 8) | st.booleans(), max_size=4) | json_values,
              "calls": st.lists(st.lists(st.text(max_size=6) | st.integers(), max_size=4), max_size=4) | json_values,
              "end": st.sampled_from(END_REASONS) | st.text(max_size=6) | json_values})


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(sample_headers, min_size=1, max_size=3), st.integers(0, 40), st.binary(max_size=200),
       st.integers(-1, 2**64))
def test_generated_v2_sample_headers_never_escape(samples: list, prompt_len: int, payload: bytes, seed: int) -> None:
    header = {"worker_id": "w", "seq": 1, "policy_version": 1, "contract_fingerprint": CONTRACT.fingerprint(),
              "task_id": "arithmetic", "prompt_id": "train:1", "prompt_len": prompt_len, "samples": samples,
              "env_seed": seed}
    check_total(join(json.dumps(header).encode(), payload, 2), Counter())


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_escape(data: bytes) -> None:
    check_total(data, Counter())
    check_total(RECORD_MAGIC + data, Counter())


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=80))
def test_key_parsing_is_total(name: str) -> None:
    key = f"runs/r1/rollouts/v00000003/{name}"
    parsed = parse_rollout_key("r1", key)
    if parsed is not None:  # whatever parses round-trips to exactly the key listed
        assert rollout_key("r1", parsed.version, parsed.worker_id, parsed.seq) == key
