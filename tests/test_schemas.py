"""The bucket-object schemas (``stoa.schemas``): round trips, objects of the previous format, hostile bytes refused
with ``BadSchemaObject`` naming the key, versions."""

from __future__ import annotations

import json

import pytest

from stoa.schemas import BadSchemaObject
from stoa.schemas.control import EvaluatorHeartbeat, LeaseRecord, RunStatus, StoredConfig, TrackerHandle
from stoa.schemas.index import IndexFile, IndexManifest
from stoa.schemas.journal import Journal, PoolUse, QuarantineRow
from stoa.schemas.rows import MetricsRow
from stoa.untrusted import BadBucketObject

KEY = "runs/r/some.json"
STATUS = RunStatus("running", 3, 100.5, 100.5, 7, 1.25, 2, 40, 100, 4)
LEASE = LeaseRecord("abc123", "host-a", 4242, 10.0, 12.5, 3, "tiny-llama", False)
BEAT = EvaluatorHeartbeat(1.7e9, "host-b", 77, 5, False)
HANDLE = TrackerHandle("wb1", "proj", None)
JOURNAL = Journal(5, 4, {"c1": PoolUse(5, 2, "runs/r/rollouts/v00000005/w-00000001.rec")},
                  {"w": QuarantineRow(10.0, 1.0, 300.0, 2.0, 4.0, "")}, 0.5)

# Objects as the code before the schemas wrote them (json.dumps of the same dicts, no "schema" field).
OLD = {
    "status": (RunStatus, b'{"heartbeat_at": 100.5, "rollouts_kept_from": 2, "state": "running", "step": 40, '
                          b'"step_s": 1.25, "target_steps": 100, "updated_at": 100.5, "version": 3, '
                          b'"wanted_groups": 7, "workers": 4}', STATUS),
    "lease": (LeaseRecord, b'{"epoch": 3, "heartbeat": 12.5, "holder": "abc123", "host": "host-a", '
                           b'"model": "tiny-llama", "pid": 4242, "released": false, "started": 10.0}', LEASE),
    "heartbeat": (EvaluatorHeartbeat, b'{"host": "host-b", "pid": 77, "stopped": false, "time": 1700000000.0, '
                                      b'"version": 5}', BEAT),
    "tracker": (TrackerHandle, b'{"id": "wb1", "project": "proj", "entity": null}', HANDLE),
}
CONTROL = {"status": STATUS, "lease": LEASE, "heartbeat": BEAT, "tracker": HANDLE}
# Per schema: variants no honest writer makes, each refused naming the key.
HOSTILE = {
    "status": [b"[]", b'{"state": "done", "version": 1, "updated_at": 1, "heartbeat_at": 1, "step_s": 0, '
               b'"rollouts_kept_from": 1}', b'{"state": "running", "version": true}', b" " * 5000],
    "lease": [b'{"holder": "h", "host": "x", "pid": 1.5, "started": 0, "heartbeat": 0, "epoch": 0}',
              b'{"holder": "h", "host": "x", "pid": 1, "started": 0, "heartbeat": 1e999, "epoch": 0}',
              b'{"holder": "h", "host": "x", "pid": 1, "started": 0, "heartbeat": 0, "epoch": 0, "released": 1}'],
    "heartbeat": [b'{"time": "now", "host": "x", "pid": 1}', b'{"time": 1, "host": {"a": 1}, "pid": 1}',
                  b'{"time": 1, "host": "x", "pid": 1, "version": -1}'],
    "tracker": [b'{"project": "p"}', b'{"id": "' + b"x" * 200 + b'"}', b'{"id": "a", "entity": 3}'],
}


@pytest.mark.parametrize("name", sorted(CONTROL))
def test_a_control_object_round_trips_and_is_written_as_before(name: str) -> None:
    cls, old, value = OLD[name]
    assert cls.parse(value.to_json(), KEY) == value
    assert json.loads(value.to_json()) == json.loads(old)  # version 1 writes no "schema" field: old readers read it
    assert cls.parse(old, KEY) == value and value.schema == 1


@pytest.mark.parametrize("name", sorted(CONTROL))
def test_hostile_control_objects_are_refused_naming_the_key(name: str) -> None:
    cls = OLD[name][0]
    for data in HOSTILE[name] + [b"{", b"[" * 100, b'{"schema": 0}', b"\xff"]:
        with pytest.raises(BadSchemaObject) as e:
            cls.parse(data, KEY)
        assert isinstance(e.value, BadBucketObject) and e.value.key == KEY and str(e.value).startswith(KEY), data
        assert cls.from_json(data) is None if hasattr(cls, "from_json") else True


@pytest.mark.parametrize("name", sorted(CONTROL))
def test_a_newer_schema_version_is_refused_and_a_later_version_is_written(name: str) -> None:
    cls, _, value = OLD[name]
    newer = {**json.loads(value.to_json()), "schema": 2}
    with pytest.raises(BadSchemaObject, match="schema"):
        cls.parse(json.dumps(newer).encode(), KEY)
    assert json.loads(value.__class__(**{**value.__dict__, "schema": 2}).to_json())["schema"] == 2
    assert cls.parse(json.dumps({**newer, "schema": 1}).encode(), KEY) == value


def test_the_journal_round_trips_and_reads_the_previous_format() -> None:
    assert Journal.parse(JOURNAL.to_json(), KEY) == JOURNAL
    old = {"version": 5, "step": 4, "pool": {"records": {"c1": [5, 2, "runs/r/rollouts/v00000005/w-00000001.rec"]}},
           "quarantine": {"v": 1, "threshold": 0.5, "workers": {"w": [10, 1, 300, 2, 4, ""]}}}
    got = Journal.parse(json.dumps(old, sort_keys=True).encode(), KEY)
    assert got == JOURNAL and got.quarantine["w"].rejected == 1.0 and got.uses["c1"].count == 2
    assert json.loads(JOURNAL.to_json()) == old  # what the previous reader (lists by position) takes
    assert Journal.from_state(old) == JOURNAL and JOURNAL.state() == old
    assert Journal.from_state(old).to_json() == json.dumps(old, sort_keys=True).encode()  # the trainer's bytes
    assert Journal.parse(b'{"step": 4, "version": 5}', KEY).state() == {"step": 4, "version": 5}


def test_malformed_journal_rows_are_dropped_and_counted() -> None:
    doc = {"step": 1, "pool": {"records": {"a": [1, 1, "k"], "b": [1, True, "k"], "c": [1, 2], "d": "x",
                                           "e": [1.0, 1, "k"]}},
           "quarantine": {"workers": {"w": [1, 0, 0, 0, 0, ""], "x": [1, 0, 0, 0, 0, "bored"],
                                      "y": [-1, 0, 0, 0, 0, ""], "z": [1, 0, 0, 0, "0", ""]}}}
    got = Journal.parse(json.dumps(doc).encode(), KEY)
    assert list(got.uses) == ["a"] and list(got.quarantine) == ["w"] and got.dropped == 7


def test_malformed_replay_rows_are_dropped_and_counted_and_good_ones_round_trip() -> None:
    doc = {"step": 1, "pool": {"records": {}, "replays": {"r": [2, 1, "k"], "s": [2, "1", "k"], "t": None,
                                                           "u": [True, 1, "k"]}}}
    got = Journal.parse(json.dumps(doc).encode(), KEY)
    assert list(got.replays) == ["r"] and not got.uses and got.dropped == 3
    assert Journal.from_state(got.state()).replays == got.replays
    assert Journal.parse(b'{"step": 1, "pool": {"records": {}, "replays": [1, 2]}}', KEY).replays == {}


@pytest.mark.parametrize("data", [b"[]", b'{"step": "4"}', b'{"version": 1.5}', b'{"step": null}',
                                  b'{"pool": []}', b'{"quarantine": 3}', b'{"schema": 2}', b'{"schema": true}',
                                  b"[" * 7 + b"]" * 7, b'{"step": 1' + b"0" * 40 + b"}"])
def test_a_hostile_journal_is_refused_naming_the_key(data: bytes) -> None:
    with pytest.raises(BadSchemaObject) as e:
        Journal.parse(data, KEY)
    assert e.value.key == KEY


def test_a_metrics_row_round_trips_and_hostile_lines_are_refused_naming_the_line() -> None:
    row = MetricsRow({"time": 1.5, "step": 3, "train/loss": 0.25, "rollout/keys": ["a", "b"], "x": None})
    line = row.dumps()
    assert line.endswith("\n") and line == json.dumps(row.values) + "\n"  # the format writers always wrote
    got = MetricsRow.parse(line.encode(), "chunk:1")
    assert got == row and (got.time, got.step, got.schema) == (1.5, 3, 1)
    assert MetricsRow.parse(b'{"time": true, "step": 1.5}').step is None
    for bad in (b"[1]", b'"x"', b"[" * 10, b'{"a": [[[[[1]]]]]}', b'{"a": NaN}', b'{"a": 1e999}', b"\xff",
                b'{"a": ' + b"9" * 40 + b"}"):
        with pytest.raises(BadSchemaObject) as e:
            MetricsRow.parse(bad, "chunk:7")
        assert e.value.key == "chunk:7" and "skipped" in str(e.value), bad


MANIFEST = IndexManifest("ab" * 16, 3, {"docs.jsonl": IndexFile(120, "cd" * 32)},
                         {"k1": 1.5, "b": 0.75, "method": "lucene", "token_pattern": "x", "stopwords": ["a"]},
                         bm25s_version="0.2.0")


def test_the_index_manifest_round_trips_and_reads_what_indexes_hold() -> None:
    assert IndexManifest.parse(MANIFEST.to_json(), KEY) == MANIFEST
    old = {"format": 1, "kind": "bm25s", "fingerprint": "ab" * 16, "docs": 3, "settings": dict(MANIFEST.settings),
           "files": {"docs.jsonl": {"size": 120, "digest": "cd" * 32}}, "bm25s_version": "0.2.0"}
    assert MANIFEST.to_json() == (json.dumps(old, indent=1, sort_keys=True) + "\n").encode()  # as indexes were written
    assert IndexManifest.parse(json.dumps(old).encode(), KEY) == MANIFEST


@pytest.mark.parametrize("change", [{"format": 2}, {"format": None}, {"docs": True}, {"files": []},
                                    {"files": {"../x": {"size": 1, "digest": "d"}}},
                                    {"files": {"stoa-index.json": {"size": 1, "digest": "d"}}},
                                    {"files": {"a": {"size": -1, "digest": "d"}}}, {"files": {"a": [1, "d"]}},
                                    {"files": {f"f{i}": {"size": 1, "digest": "d"} for i in range(65)}},
                                    {"settings": "lucene"}, {"fingerprint": "x" * 65}, {"kind": 3}])
def test_a_hostile_index_manifest_is_refused_naming_the_key(change: dict) -> None:
    doc = {**json.loads(MANIFEST.to_json()), **change}
    with pytest.raises(BadSchemaObject) as e:
        IndexManifest.parse(json.dumps(doc).encode(), KEY)
    assert e.value.key == KEY and "rebuild the index" in str(e.value)


def test_the_stored_trainer_config_round_trips_and_hostile_ones_are_refused_naming_the_key() -> None:
    cfg = StoredConfig({"lr": 0.001, "steps": 30, "report_to": ["wandb"]}, 1.7e9)
    assert StoredConfig.parse(cfg.to_json(), KEY) == cfg
    old = {"format": "stoa-trainer-config-1", "created_at": 1.7e9, "settings": {"lr": 0.001, "steps": 30,
                                                                              "report_to": ["wandb"]}}
    assert cfg.to_json() == json.dumps(old, sort_keys=True, indent=1).encode()  # as trainers wrote it
    assert StoredConfig.parse(b'{"format": "stoa-trainer-config-1", "settings": {}, "created_at": "x"}').created_at \
        is None
    for bad in (b"[]", b'{"format": "stoa-trainer-config-2", "settings": {}}', b'{"settings": {}}',
                b'{"format": "stoa-trainer-config-1", "settings": []}', b'{"format": "stoa-trainer-config-1"}',
                b" " * (2 << 20)):
        with pytest.raises(BadSchemaObject) as e:
            StoredConfig.parse(bad, KEY)
        assert e.value.key == KEY, bad
