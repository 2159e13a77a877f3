"""Control objects read from the bucket are parsed totally: every crafted variant is a named refusal.

Each reader (the contract, the weights pointer, an anchor manifest, the checkpoint pointer, the journal, the
lease, the evaluator heartbeat, the W&B handle, the stored trainer configuration, a join card) gets the same
hostile variants: deep nesting, over its size cap, the wrong JSON type, the wrong encoding, integers past
int64 or past Python's digit limit, NaN/Infinity, a bool or a string where an integer belongs. A refusal is
the reader's own exception or None, never anything else. A pointer at version 2**63-1 is refused by a sync
without sizing anything by it, and a trainer resuming over it stops with one line.
"""

from __future__ import annotations

import json
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

from stoa.bucket import open_bucket
from stoa.cli import main
from stoa.config import ConfigError
from stoa.contract import ContractMismatch, ModelSpec, RunContract, SamplingSpec
from stoa.join.card import CardError, JoinCard, read_card
from stoa.layout import contract_key, pointer_key
from stoa.schemas.control import EvaluatorHeartbeat as Heartbeat
from stoa.schemas.control import LeaseRecord
from stoa.telemetry.trackers import _IdStore
from stoa.trainer.lease import Lease, LeaseHeld
from stoa.trainer.resume import config_bytes, parse_config
from stoa.untrusted import BadBucketObject, loads_bounded, nesting_depth
from stoa.weights.anchor import encode_anchor, load_manifest
from stoa.weights.errors import AnchorError, SyncError
from stoa.weights.planes import state_from_f32
from stoa.weights.pointer import Pointer
from stoa.weights.publish import WeightPublisher
from stoa.weights.sync import WeightSync, chain_to

RUN = "r1"
HOLE = "__hole__"
"""Placeholder a variant puts in a field; the JSON text then gets the raw literal in its place."""


def _contract() -> RunContract:
    return RunContract(run_id=RUN, model=ModelSpec("llama", "c" * 32, "t" * 32, 512, eos_token_ids=(2,)),
                       n_samples=8, plane="bf16", task_id="arithmetic", task_spec={"digits": 2},
                       reward_version="1", sampling=SamplingSpec(max_new_tokens=16), created_at=1.7e9)


class _Get:
    """A bucket holding one object (whatever key is asked)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def get(self, key: str) -> bytes:
        return self.data


def _raises(exc: type[BaseException] | tuple[type[BaseException], ...], read: Callable[[bytes], Any],
            check: Callable[[BaseException], bool] = lambda e: True) -> Callable[[bytes], bool]:
    def refused(data: bytes) -> bool:
        try:
            read(data)
        except exc as e:
            return check(e)
        return False
    return refused


def _none(read: Callable[[bytes], Any]) -> Callable[[bytes], bool]:
    return lambda data: read(data) is None


def _card(tmp: Path) -> Callable[[bytes], Any]:
    def read(data: bytes) -> Any:
        path = tmp / "card.json"
        path.write_bytes(data)
        return read_card(path)
    return read


def _journal(data: bytes) -> Any:
    from stoa.trainer.checkpoint import read_journal

    return read_journal(_Get(data), RUN)  # type: ignore[arg-type]


def _ckpt_ref(data: bytes) -> Any:
    from stoa.trainer.checkpoint import CheckpointRef

    return CheckpointRef.from_json(data)


class Reader(NamedTuple):
    """One reader: a valid document, its refusal test, its size cap, an integer and a string field."""

    valid: dict[str, Any]
    refused: Callable[[bytes], bool]
    cap: int
    int_field: str | None
    str_field: str | None


FIELDS: dict[str, tuple[str | None, str | None]] = {
    "contract": ("n_samples", "run_id"), "pointer": ("anchor_version", "run_id"), "manifest": ("size", "state_hash"),
    "checkpoint": ("world_size", "tag"), "journal": ("step", None), "lease": ("pid", "holder"),
    "heartbeat": ("pid", "host"), "tracker": (None, "id"), "trainer config": (None, None), "card": ("n_samples", "run"),
}
"""Per reader, an integer field and a string field of its document (None: it has none at the top level)."""


def _readers(tmp: Path) -> dict[str, Reader]:
    from stoa.trainer.checkpoint import CheckpointError, CheckpointRef

    state = state_from_f32({"w": np.ones((4, 8), np.float32)}, "bf16")
    manifest = encode_anchor(state, run_id=RUN, version=1, plane="bf16")[1]
    pointer = Pointer(RUN, 3, 1, "bf16", "xxh3:" + "0" * 32, "2026-01-01T00:00:00.000+00:00")
    ref = CheckpointRef("s0000000001-0a0b0c0d", 1, 1, 1, {".metadata": 3})
    lease = LeaseRecord("abc", "host", 123, 1.7e9, 1.7e9, 1)
    card = JoinCard(bucket=str(tmp), run=RUN, n_samples=8, plane="bf16", task="arithmetic", contract="f" * 16)
    table: dict[str, tuple[dict[str, Any], Callable[[bytes], bool], int]] = {
        "contract": (json.loads(_contract().to_json()), _raises(BadBucketObject, RunContract.from_json), 1 << 20),
        "pointer": (json.loads(pointer.to_json()), _raises(
            SyncError, Pointer.from_json, lambda e: getattr(e, "reason", "") == "bad_pointer"), 64 << 10),
        "manifest": (manifest, _raises(AnchorError, load_manifest), 16 << 20),
        "checkpoint": (json.loads(ref.to_json()), _raises(CheckpointError, _ckpt_ref), 1 << 20),
        "journal": ({"version": 3, "step": 2, "pool": {"records": {}}, "quarantine": {}}, _none(_journal), 64 << 20),
        "lease": (asdict(lease), _none(LeaseRecord.from_json), 64 << 10),
        "heartbeat": ({"time": 1.7e9, "host": "h", "pid": 5, "version": 2, "stopped": False},
                      _none(Heartbeat.from_json), 4096),
        "tracker": ({"id": "abc", "project": "p", "entity": None},
                    _none(lambda d: _IdStore(_Get(d), RUN, tmp).load()), 4096),
        "trainer config": (json.loads(config_bytes(_trainer_cfg())), _raises(
            ConfigError, lambda d: parse_config(d, RUN)), 1 << 20),
        "card": ({**asdict(card), "credentials": []}, _raises(CardError, _card(tmp)), 256 << 10),
    }
    return {name: Reader(*row, *FIELDS[name]) for name, row in table.items()}


def _trainer_cfg() -> Any:
    from stoa.config import TrainerConfig

    return TrainerConfig(run=RUN)


def _with(valid: dict[str, Any], field: str | None, literal: str) -> bytes | None:
    if field is None:
        return None
    return json.dumps({**valid, field: HOLE}).replace(json.dumps(HOLE), literal).encode("utf-8")


VARIANTS: dict[str, Callable[[Reader], bytes | None]] = {  # a variant returns None for a reader without its field
    "deep arrays": lambda r: b"[" * 100_000 + b"]" * 100_000,
    "deep objects": lambda r: b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "deep in a field": lambda r: _with(r.valid, r.str_field or "x", "[" * 100_000 + "]" * 100_000),
    "unterminated strings": lambda r: b'"' + b'\\"' * 300_000,
    "over the size cap": lambda r: json.dumps({**r.valid, "pad": "x" * r.cap}).encode(),
    "a list": lambda r: json.dumps([r.valid]).encode(),
    "a string": lambda r: b'"hello"',
    "a number": lambda r: b"7",
    "null": lambda r: b"null",
    "empty": lambda r: b"",
    "UTF-16": lambda r: json.dumps(r.valid).encode("utf-16"),
    "UTF-16 without BOM": lambda r: json.dumps(r.valid).encode("utf-16-le"),
    "UTF-8 BOM": lambda r: b"\xef\xbb\xbf" + json.dumps(r.valid).encode(),
    "invalid UTF-8": lambda r: _with(r.valid, r.str_field, '"ab\xff"').replace(b"\xc3\xbf", b"\xff")
    if r.str_field else None,
    "lone surrogate": lambda r: _with(r.valid, r.str_field, '"\\ud800"'),
    "string is a number": lambda r: _with(r.valid, r.str_field, "5"),
    "2**64": lambda r: _with(r.valid, r.int_field, str(2**64)),
    "10**5000 as digits": lambda r: _with(r.valid, r.int_field, "1" + "0" * 5000),
    "-2**63-1": lambda r: _with(r.valid, r.int_field, str(-(2**63) - 1)),
    "NaN": lambda r: _with(r.valid, r.int_field, "NaN"),
    "Infinity": lambda r: _with(r.valid, r.int_field, "Infinity"),
    "1e999": lambda r: _with(r.valid, r.int_field, "1e999"),
    "bool for an int": lambda r: _with(r.valid, r.int_field, "true"),
    "string for an int": lambda r: _with(r.valid, r.int_field, '"3"'),
    "float for an int": lambda r: _with(r.valid, r.int_field, "3.5"),
    "list for an int": lambda r: _with(r.valid, r.int_field, "[3]"),
}


@pytest.fixture(scope="module")
def readers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Reader]:
    return _readers(tmp_path_factory.mktemp("readers"))


@pytest.mark.parametrize("reader", list(FIELDS))
def test_every_reader_accepts_its_own_document(reader: str, readers: dict[str, Reader]) -> None:
    r = readers[reader]
    assert not r.refused(json.dumps(r.valid).encode())


def _applies(reader: str, variant: str) -> bool:
    return VARIANTS[variant](Reader({}, lambda d: True, 0, *FIELDS[reader])) is not None


@pytest.mark.parametrize(("reader", "variant"), [(r, v) for r in FIELDS for v in VARIANTS if _applies(r, v)])
def test_every_hostile_variant_is_a_named_refusal(reader: str, variant: str, readers: dict[str, Reader]) -> None:
    r = readers[reader]
    data = VARIANTS[variant](r)
    assert data is not None
    t0 = time.perf_counter()
    assert r.refused(data), f"{reader} accepted {variant}"
    assert time.perf_counter() - t0 < 5.0


@pytest.mark.parametrize("reader", ["contract", "checkpoint", "lease", "heartbeat", "card"])
def test_int64_max_is_refused_where_a_field_is_bounded_below_it(reader: str, readers: dict[str, Reader]) -> None:
    r = readers[reader]
    assert r.refused(_with(r.valid, r.int_field, str(2**63 - 1)) or b"")


def test_contract_bounds_what_workers_size_by_and_keeps_the_schema_check() -> None:
    valid = json.loads(_contract().to_json())
    for path, value in ((("sampling", "max_new_tokens"), 2**40), (("model", "vocab_size"), 0),
                        (("model", "eos_token_ids"), [512]), (("sampling", "temperature"), 0),
                        (("task_spec",), []), (("model", "architecture"), None)):
        doc = json.loads(json.dumps(valid))
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        parent[path[-1]] = value
        with pytest.raises(BadBucketObject, match=r"^run\.json is not a run contract \(.*restore it from a backup"):
            RunContract.from_json(json.dumps(doc).encode())
    with pytest.raises(BadBucketObject, match="unknown fields"):
        RunContract.from_json(json.dumps({**valid, "extra": 1}).encode())
    with pytest.raises(ContractMismatch, match="schema_version"):
        RunContract.from_json(json.dumps({**valid, "schema_version": True}).encode())
    assert RunContract.from_json(_contract().to_json()) == _contract()


def test_depth_scan_is_linear() -> None:
    """An unterminated string used to make every later quote rescan the rest (80 KB took 12 s)."""
    data = b'"' + b'\\"' * (1 << 20)
    t0 = time.perf_counter()
    assert nesting_depth(data) == 0
    assert time.perf_counter() - t0 < 2.0
    assert nesting_depth(b'[{"a": "]]]["}, [[1]]]') == 3 and nesting_depth(b"[" * 3_000_000) == 3_000_000
    with pytest.raises(ValueError):
        loads_bounded(data, max_bytes=len(data))


def _published(tmp_path: Path, versions: int = 2) -> tuple[Any, list[dict[str, np.ndarray]]]:
    bucket = open_bucket(str(tmp_path / "b"))
    rng = np.random.default_rng(0)
    sts = [state_from_f32({"w": rng.standard_normal((64, 32)).astype(np.float32)}, "bf16") for _ in range(versions)]
    pub = WeightPublisher(bucket, RUN, "bf16", anchor_every=100)
    for v, st in enumerate(sts, 1):
        pub.publish(v, st)
    return bucket, sts


def _plant_pointer(bucket: Any, version: int) -> None:
    p = Pointer.from_json(bucket.get(pointer_key(RUN)))
    bucket.put(pointer_key(RUN), Pointer(RUN, version, p.anchor_version, "bf16", p.state_hash, p.updated_at).to_json())


def test_a_pointer_at_int64_max_is_refused_without_allocating(tmp_path: Path) -> None:
    bucket, _ = _published(tmp_path)
    worker = WeightSync(bucket, RUN, "bf16")
    assert worker.sync()[0] == 2
    _plant_pointer(bucket, 2**63 - 1)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        assert worker.poll() is not None
        with pytest.raises(SyncError) as ei:
            worker.sync()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ei.value.reason == "pointer_ahead" and f"v{2**63 - 1}" in str(ei.value)
    assert time.perf_counter() - t0 < 2.0 and peak < 4 << 20  # list(range(...)) here was a MemoryError
    assert worker.version == 2 and worker.metrics["path"] == "failed"  # keeps its weights, retries later
    # a refusal of the pointer, as for any other planted pointer: the worker says "refused current.json"
    assert [(r.key, r.reason) for r in worker.refusals] == [(pointer_key(RUN), "pointer_ahead")]
    fresh = WeightSync(bucket, RUN, "bf16")
    with pytest.raises(SyncError, match="pointer_ahead"):
        fresh.sync()
    assert chain_to(0, 2**63 - 1, {1: 10, 2: 10}) is None and chain_to(0, 2, {1: 10, 2: 10}) == [1, 2]
    assert chain_to(5, 3, {4: 1}) is None


def test_a_trainer_resuming_over_a_planted_pointer_stops_with_one_line(tmp_path: Path) -> None:
    bucket, _ = _published(tmp_path)
    _plant_pointer(bucket, 2**63 - 1)
    with pytest.raises(BadBucketObject) as ei:
        WeightPublisher(bucket, RUN, "bf16").resume()
    assert str(ei.value).startswith(f"{pointer_key(RUN)} is ahead of the published weights (current.json names "
                                    f"v{2**63 - 1} but the newest weights object listed is v2")
    assert "restore it from a backup" in str(ei.value) and "\n" not in str(ei.value)
    bucket.put(pointer_key(RUN), b"[" * 100_000)
    with pytest.raises(BadBucketObject, match="is not a weights pointer"):
        WeightPublisher(bucket, RUN, "bf16").resume()


def test_a_worker_stops_on_a_hostile_contract_with_one_line_and_exit_13(tmp_path: Path, capsys) -> None:
    bucket = open_bucket(str(tmp_path / "b"))
    bucket.put(contract_key(RUN), b"[" * 100_000)
    before = sorted(p for p in (tmp_path / "b").rglob("*") if p.is_file() and ".stoa" not in p.parts)
    code = main(["worker", "--bucket", str(tmp_path / "b"), "--run", RUN, "--wait-seconds", "0.3"])
    err = capsys.readouterr().err
    assert code == 13 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"stoa: {contract_key(RUN)} is not a run contract (JSON nested 100000 deep > 16)")
    assert sorted(p for p in (tmp_path / "b").rglob("*") if p.is_file() and ".stoa" not in p.parts) == before


def test_a_hostile_lease_is_not_a_lease_and_the_trainer_names_the_fix(tmp_path: Path) -> None:
    from stoa.observe.runs import lease_live

    bucket = open_bucket(str(tmp_path / "b"))
    bucket.put(f"runs/{RUN}/trainer/lease.json", b"[" * 100_000)
    lease = Lease(bucket, RUN)
    assert lease.read()[0] is None and not lease_live(b"[" * 100_000, time.time())
    with pytest.raises(LeaseHeld, match="unreadable lease .* --take-over"):
        lease.acquire()
    assert lease.acquire(take_over=True) is None


def test_a_hostile_journal_is_ignored_with_a_warning_and_a_bad_checkpoint_pointer_is_exit_13(caplog) -> None:
    from stoa.cli import user_error
    from stoa.trainer.checkpoint import CheckpointError

    assert _journal(b"[]") is None and "ignoring runs/r1/trainer/journal.json" in caplog.text
    assert _journal(b'{"step": 4, "version": 5}') == {"step": 4, "version": 5}
    with pytest.raises(CheckpointError) as ei:
        _ckpt_ref(b"[" * 100_000)
    row = user_error(ei.value)
    assert row is not None and row.code == 13 and "delete trainer/checkpoint.json" in row.line(ei.value)


def test_typed_readers_take_exact_types() -> None:
    from stoa.untrusted import check_int, check_number, field_bool, field_str, int_list

    for bad in (lambda: field_str({"a": "x\ud800"}, "a"), lambda: check_int(True, "v"), lambda: check_int(3.0, "v"),
                lambda: check_number(float("nan"), "v"), lambda: check_number(False, "v"),
                lambda: field_bool({"b": 1}, "b"), lambda: int_list([1, -1], "shape"),
                lambda: loads_bounded("[1]", max_bytes=9)):  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            bad()
    assert loads_bounded(memoryview(b"[1]"), max_bytes=3) == [1] and field_str({"a": "é"}, "a") == "é"


def test_planted_model_files_are_refused_before_a_reader_parses_them(tmp_path: Path, monkeypatch) -> None:
    import stoa.contract as contract
    from stoa.contract import download_model_files
    from stoa.layout import model_file_key

    bucket = open_bucket(str(tmp_path / "b"))
    bucket.put(model_file_key(RUN, "tokenizer.json"), b'{"model": {"vocab": {"a": 0}}}')
    bucket.put(model_file_key(RUN, "config.json"), b'{"a":' * 1000 + b"1" + b"}" * 1000)
    bucket.put(model_file_key(RUN, "bad name.json"), b"{}")  # not a model file name: never fetched
    with pytest.raises(BadBucketObject, match=r"config\.json is not a model file \(JSON nested 1000 deep > 64\)"):
        download_model_files(bucket, RUN, tmp_path / "m")
    bucket.put(model_file_key(RUN, "config.json"), b'{"vocab_size": 512}')
    assert sorted(p.name for p in download_model_files(bucket, RUN, tmp_path / "m").iterdir()) == [
        "config.json", "tokenizer.json"]
    monkeypatch.setattr(contract, "MAX_MODEL_FILE_BYTES", 16)
    with pytest.raises(BadBucketObject, match=r"config\.json is listed at 19 bytes \(> 16\)"):
        download_model_files(bucket, RUN, tmp_path / "m2")
