"""Record codec and validation: round trip, and every kind of bad input is rejected with its reason."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stoa.contract import ContractMismatch, ModelSpec, RunContract, SamplingSpec
from stoa.rollouts.records import RecordRejected, RolloutRecord, Sample, validate_record


def make_contract(**kw) -> RunContract:
    base = dict(
        run_id="r1",
        model=ModelSpec("llama", "c" * 32, "t" * 32, vocab_size=100, eos_token_ids=(2,)),
        n_samples=2,
        plane="bf16",
        task_id="arithmetic",
        task_spec={"digits": 2},
        reward_version="1",
        sampling=SamplingSpec(1.0, 1.0, 8),
    )
    base.update(kw)
    return RunContract(**base)


def make_record(contract: RunContract, **kw) -> RolloutRecord:
    samples = [
        Sample(np.array([5, 6, 2], np.int32), np.array([-0.5, -1.0, -0.1], np.float32), 1.0, "stop"),
        Sample(np.array([7], np.int32), np.array([-2.0], np.float32), 0.0, "length"),
    ]
    base = dict(worker_id="w-abc", seq=3, policy_version=1, contract_fingerprint=contract.fingerprint(),
                task_id="arithmetic", prompt_id="train:1", prompt_tokens=np.array([1, 2, 3], np.int32),
                samples=samples)
    base.update(kw)
    return RolloutRecord(**base)


def test_round_trip_is_exact():
    c = make_contract()
    rec = make_record(c, timings={"generate_s": 0.5})
    back = RolloutRecord.decode(rec.encode())
    assert back.worker_id == rec.worker_id and back.seq == 3 and back.prompt_id == "train:1"
    np.testing.assert_array_equal(back.prompt_tokens, rec.prompt_tokens)
    for a, b in zip(back.samples, rec.samples, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        assert a.reward == b.reward and a.finish_reason == b.finish_reason
    assert back.timings == {"generate_s": 0.5}
    validate_record(back, c, current_version=1)


def test_record_is_compact():
    c = make_contract()
    data = make_record(c).encode()
    assert len(data) < 600  # header + 4 int32 + 8 floats, no pickle


@pytest.mark.parametrize(
    "mutate,reason",
    [
        (lambda d: d[:-1], "digest"),
        (lambda d: d[:10], "malformed"),
        (lambda d: b"XXXXXXXX" + d[8:], "malformed"),
        (lambda d: d[:20] + bytes([d[20] ^ 0xFF]) + d[21:], "digest"),
    ],
)
def test_corrupt_bytes_rejected(mutate, reason):
    data = make_record(make_contract()).encode()
    with pytest.raises(RecordRejected) as e:
        RolloutRecord.decode(mutate(data))
    assert e.value.reason == reason


def _reframe(header_edit) -> bytes:
    """Re-encode a record after editing its JSON header (digest recomputed: a 'valid' liar)."""
    import struct

    import xxhash

    data = make_record(make_contract()).encode()
    body = data[:-16]
    magic, schema, res, hlen = struct.unpack_from("<8sHHI", body)
    header = json.loads(body[16 : 16 + hlen])
    header_edit(header)
    hb = json.dumps(header).encode()
    body2 = struct.pack("<8sHHI", magic, schema, res, len(hb)) + hb + body[16 + hlen :]
    return body2 + xxhash.xxh3_128_digest(body2)


def test_lying_sizes_rejected():
    def edit(h):
        h["samples"][0]["len"] = 10

    with pytest.raises(RecordRejected) as e:
        RolloutRecord.decode(_reframe(edit))
    assert e.value.reason == "length_mismatch"


def test_bad_header_types_rejected():
    def edit(h):
        h["prompt_len"] = -3

    with pytest.raises(RecordRejected) as e:
        RolloutRecord.decode(_reframe(edit))
    assert e.value.reason == "malformed"


def test_schema_version_rejected():
    import struct

    import xxhash

    data = make_record(make_contract()).encode()
    body = bytearray(data[:-16])
    struct.pack_into("<H", body, 8, 99)
    with pytest.raises(RecordRejected) as e:
        RolloutRecord.decode(bytes(body) + xxhash.xxh3_128_digest(bytes(body)))
    assert e.value.reason == "schema"


def test_oversize_rejected_before_decoding():
    with pytest.raises(RecordRejected) as e:
        RolloutRecord.decode(b"\0" * (64 * 1024 * 1024 + 1))
    assert e.value.reason == "oversize"


@pytest.mark.parametrize(
    "edit,reason",
    [
        (lambda r, c: setattr(r, "contract_fingerprint", "0" * 16), "fingerprint"),
        (lambda r, c: setattr(r, "task_id", "gsm8k"), "task"),
        (lambda r, c: r.samples.pop(), "group_size"),
        (lambda r, c: setattr(r.samples[0], "tokens", np.array([5, 600, 2], np.int32)), "vocab"),
        (lambda r, c: setattr(r, "prompt_tokens", np.array([-1, 2], np.int32)), "vocab"),
        (lambda r, c: setattr(r.samples[1], "logprobs", np.array([np.nan], np.float32)), "nonfinite"),
        (lambda r, c: setattr(r.samples[1], "logprobs", np.array([0.5], np.float32)), "nonfinite"),
        (lambda r, c: setattr(r.samples[1], "reward", float("inf")), "nonfinite"),
        (lambda r, c: setattr(r.samples[0], "logprobs", np.array([-1.0], np.float32)), "length_mismatch"),
        (lambda r, c: setattr(r.samples[0], "tokens", np.arange(9, dtype=np.int32)), "length_mismatch"),
        (lambda r, c: setattr(r.samples[0], "finish_reason", "bogus"), "finish_reason"),
        (lambda r, c: setattr(r, "policy_version", 7), "version"),
    ],
)
def test_validation_reasons(edit, reason):
    c = make_contract()
    rec = make_record(c)
    edit(rec, c)
    with pytest.raises(RecordRejected) as e:
        validate_record(rec, c, current_version=2)
    assert e.value.reason == reason


def test_oversize_completion_rejected():
    c = make_contract()
    rec = make_record(c)
    rec.samples[0] = Sample(np.arange(9, dtype=np.int32), np.full(9, -1.0, np.float32), 0.0, "length")
    with pytest.raises(RecordRejected) as e:
        validate_record(rec, c)
    assert e.value.reason == "oversize"


def test_contract_round_trip_and_mismatch_names_field():
    c = make_contract(created_at=123.0)
    back = RunContract.from_json(c.to_json())
    assert back == c
    other = make_contract(n_samples=4, plane="int8g64")
    assert sorted(c.mismatches(other)) == ["n_samples", "plane"]
    m = make_contract(model=ModelSpec("llama", "c" * 32, "x" * 32, vocab_size=100, eos_token_ids=(2,)))
    assert c.mismatches(m) == ["model.tokenizer_hash"]
    assert c.fingerprint() != other.fingerprint()
    assert c.fingerprint() == make_contract(created_at=999.0).fingerprint()


def test_contract_schema_and_garbage():
    d = json.loads(make_contract().to_json())
    d["schema_version"] = 2
    with pytest.raises(ContractMismatch, match="schema_version"):
        RunContract.from_json(json.dumps(d).encode())
    with pytest.raises(ValueError):
        RunContract.from_json(b"not json")
    with pytest.raises(ValueError):
        RunContract.from_json(b'{"schema_version": 1}')

