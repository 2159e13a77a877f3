"""Fuzzing the signatures: no mutation of a signed pointer or contract is accepted as something else.

Every mutated pointer either is refused with a ``SyncError`` reason or parses to exactly the pointer the run's
key signed (a mutation that only moved whitespace); every mutated contract is refused with ``ValueError`` or
``ContractMismatch`` (``RunKeyError`` for the signature) or is the signed contract itself. Nothing else escapes.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoa.contract import ContractMismatch, ModelSpec, RunContract, SamplingSpec
from stoa.weights.ed25519 import signature_problem
from stoa.weights.errors import SyncError
from stoa.weights.pointer import Pointer
from stoa.weights.signing import RunSigner, create_key
from tests.weights._weights_fuzz import DEEP, NASTY, RUN, dumps, mutate_bytes, mutate_json

_SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


def _signer(tmp_path_factory) -> RunSigner:
    return create_key(tmp_path_factory.mktemp("k") / "run.ed25519")


def _signed_pointer(signer: RunSigner) -> Pointer:
    p = Pointer(RUN, 7, 4, "bf16", "xxh3-128:" + "0" * 32, "2026-01-01T00:00:00.000+00:00")
    return Pointer(**{**p.__dict__, "signature": signer.sign(p.signed_bytes())})


def _pointer_outcome(data: bytes, public: str, good: Pointer, what: str) -> str:
    try:
        p = Pointer.from_json(data).check_signature(public)
    except SyncError as e:
        return e.reason
    except Exception as e:  # noqa: BLE001 - the point: nothing else may escape
        raise AssertionError(f"{what}: {type(e).__name__}: {str(e)[:200]}") from e
    assert p == good, f"{what}: accepted a pointer the key never signed: {p}"
    return "ok"


def test_signed_pointer_mutations_are_refused_or_unchanged(tmp_path_factory) -> None:
    signer = _signer(tmp_path_factory)
    good = _signed_pointer(signer)
    raw, d = good.to_json(), json.loads(good.to_json())
    rng = random.Random(11)
    reasons: Counter[str] = Counter()
    for i in range(3000):
        data = mutate_bytes(rng, raw) if i % 2 else dumps(mutate_json(rng, d))
        reasons[_pointer_outcome(data, signer.public_hex, good, f"pointer mutation {i}")] += 1
    print(f"\n[fuzz] signed pointer: {sum(reasons.values())} inputs, outcomes {dict(reasons.most_common())}")
    assert reasons["bad_signature"] > 300 and reasons["malformed_signature"] > 0 and reasons["unsigned"] > 0


def test_every_field_of_a_signed_pointer_is_covered(tmp_path_factory) -> None:
    signer = _signer(tmp_path_factory)
    good = _signed_pointer(signer)
    d = json.loads(good.to_json())
    for name in d:
        if name == "signature":
            continue
        for value in NASTY:
            if value != DEEP and value != d[name]:
                _pointer_outcome(dumps({**d, name: value}), signer.public_hex, good, f"{name}={value!r:.40}")


@_SETTINGS
@given(st.one_of(st.text(max_size=200), st.binary(max_size=80).map(bytes.hex), st.integers(), st.none(),
                 st.lists(st.integers(), max_size=3), st.sampled_from(NASTY[:-3])))
def test_any_signature_value_is_a_named_refusal(signature: Any) -> None:
    p = Pointer(RUN, 7, 4, "bf16", "h", "t")
    d = {**json.loads(p.to_json()), "signature": signature}
    key = "ab" * 32
    try:
        Pointer.from_json(dumps(d)).check_signature(key)
    except SyncError as e:
        assert e.reason in ("bad_pointer", "unsigned", "malformed_signature", "bad_signature")
    else:
        raise AssertionError(f"accepted signature {signature!r}")
    assert signature_problem(key, signature, b"x") is not None  # total over any value


def _contract() -> RunContract:
    return RunContract(run_id=RUN, model=ModelSpec("llama", "c" * 8, "t" * 8, 100, eos_token_ids=(2,)), n_samples=2,
                       plane="bf16", task_id="toy", task_spec={"k": 1}, reward_version="1",
                       sampling=SamplingSpec(), created_at=1.5)


def test_signed_contract_field_damage_is_refused(tmp_path_factory) -> None:
    signer = _signer(tmp_path_factory)
    good = signer.sign_contract(_contract())
    d = json.loads(good.to_json())
    outcomes: Counter[str] = Counter()
    for name in d:
        for value in NASTY:
            if value == DEEP or value == d[name] or name == "schema_version":
                continue
            try:
                c = RunContract.from_json(dumps({**d, name: value}))
            except (ValueError, ContractMismatch) as e:
                outcomes[type(e).__name__] += 1
                continue
            except Exception as e:  # noqa: BLE001 - the point: nothing else may escape
                raise AssertionError(f"{name}={value!r:.40}: {type(e).__name__}: {str(e)[:200]}") from e
            assert c == good, f"{name}={value!r:.40} accepted"
            outcomes["ok"] += 1
    print(f"\n[fuzz] signed contract fields: {dict(outcomes)}")
    # a mistyped or out-of-range field is refused by the parser (BadBucketObject), a well-typed change by the
    # signature (RunKeyError); only the untouched value is accepted
    assert outcomes["RunKeyError"] > 50 and outcomes["BadBucketObject"] > 100 and set(outcomes) == {
        "RunKeyError", "BadBucketObject", "ok"}
