"""A run contract names task data only by content address in the bucket: workers and evaluators refuse a local,
absolute, home or ``..`` path, a URL, a malformed or mismatched ``bucket:`` reference, with one line and exit 3,
before anything it names is opened (the trainer, which uploads the user's files, still reads local paths)."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from stoa.bucket import open_bucket
from stoa.cli import main
from stoa.contract import ModelSpec, RunContract, SamplingSpec
from stoa.layout import contract_key, task_data_key
from stoa.tasks.data import (
    TaskDataMismatch,
    TaskDataRefused,
    contract_refs,
    localize_contract_options,
    localize_options,
    upload_task_files,
)

TRAIN = b'{"question": "1 + 1?", "answer": "2\\n#### 2"}\n'
DIGEST = hashlib.sha256(TRAIN).hexdigest()
REF = f"bucket:{DIGEST}/train.jsonl"

REFUSED = {
    "absolute": "/etc/passwd",
    "dot-dot": "../x",
    "dot-dot inside": "data/../../x",
    "file URL": "file:///x",
    "http URL": "http://example.com/train.jsonl",
    "s3 URL": "s3://bucket/train.jsonl",
    "home": "~/x",
    "windows absolute": "C:\\data\\train.jsonl",
    "relative": "train.jsonl",
    "empty": "",
    "traversal in the reference": f"bucket:{DIGEST}/../x",
    "a folder in the reference": f"bucket:{DIGEST}/a/b",
    "short digest": f"bucket:{DIGEST[:-1]}/train.jsonl",
    "upper-case digest": f"bucket:{DIGEST.upper()}/train.jsonl",
    "hidden name": f"bucket:{DIGEST}/.train.jsonl",
    "newline": f"{REF}\n",
    "a number": 3,
    "a list": [REF],
    "an object": {"path": REF},
}
"""Values of gsm8k's ``path`` that a contract may not use."""


def _contract(task_spec: dict) -> RunContract:
    return RunContract(run_id="r", model=ModelSpec("llama", "c" * 16, "t" * 16, 512), n_samples=2, plane="bf16",
                       task_id="gsm8k", task_spec=task_spec, reward_version="1",
                       sampling=SamplingSpec(max_new_tokens=4), created_at=time.time())


@pytest.fixture
def never_loaded(monkeypatch):
    """Fails the test if gsm8k loads any file (the refusal comes before anything is opened)."""
    opened: list = []
    monkeypatch.setattr("stoa.tasks.gsm8k.load_jsonl", lambda p: opened.append(p) or [])
    yield opened
    assert opened == []


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_every_file_option_that_is_not_a_content_address_is_refused_before_anything_is_fetched(
        tmp_path, kind, never_loaded):
    bucket = open_bucket(str(tmp_path / "b"))
    got: list = []
    bucket.get_file = lambda key, path: got.append(key)  # type: ignore[method-assign]
    cache = tmp_path / "cache"
    for option, spec in (("path", {"path": REFUSED[kind]}), ("test_path", {"path": REF, "test_path": REFUSED[kind]})):
        with pytest.raises(TaskDataRefused, match=rf"task_spec\.{option} \(the run contract names") as e:
            localize_contract_options(bucket, "r", "gsm8k", spec, cache_dir=cache)
        assert "\n" not in str(e.value) and isinstance(e.value, TaskDataMismatch)
    assert got == [] and not cache.exists()  # nothing downloaded, not even the good reference beside it
    with pytest.raises(TaskDataRefused, match=r"task_spec\.corpus"):
        contract_refs("searchqa", {"path": REF, "corpus": REFUSED[kind]})


def test_the_message_names_what_the_value_is():
    names = {kind: str(pytest.raises(TaskDataRefused, contract_refs, "gsm8k", {"path": v}).value)
             for kind, v in REFUSED.items()}
    assert "absolute path '/etc/passwd'" in names["absolute"] and "climbs out with '..'" in names["dot-dot"]
    assert "URL 'file:///x'" in names["file URL"] and "home path '~/x'" in names["home"]
    assert "malformed reference" in names["traversal in the reference"] and "a list" in names["a list"]
    assert "absolute path" in names["windows absolute"] and "local path 'train.jsonl'" in names["relative"]


def test_a_reference_whose_content_differs_from_its_hash_is_refused_and_never_kept(tmp_path, never_loaded):
    bucket = open_bucket(str(tmp_path / "b"))
    wrong = "ab" * 32
    bucket.put(task_data_key("r", wrong, "train.jsonl"), TRAIN)  # the bytes do not hash to the name
    cache = tmp_path / "cache"
    with pytest.raises(TaskDataMismatch, match=r"task_spec\.path .*has SHA-256"):
        localize_contract_options(bucket, "r", "gsm8k", {"path": f"bucket:{wrong}/train.jsonl"}, cache_dir=cache)
    assert [p for p in cache.rglob("*") if p.is_file()] == []
    with pytest.raises(TaskDataMismatch, match="no task data object"):
        localize_contract_options(bucket, "r", "gsm8k", {"path": REF}, cache_dir=cache)


def test_content_addressed_data_is_fetched_and_other_options_pass(tmp_path):
    bucket = open_bucket(str(tmp_path / "b"))
    local = tmp_path / "train.jsonl"
    local.write_bytes(TRAIN)
    from stoa.tasks.data import DataRef, TaskFile

    upload_task_files(bucket, "r", [TaskFile("path", local, DataRef(DIGEST, "train.jsonl"))])
    opts = localize_contract_options(bucket, "r", "gsm8k", {"path": REF, "n_train": 1, "test_path": None},
                                     cache_dir=tmp_path / "cache")
    assert Path(str(opts["path"])).read_bytes() == TRAIN and opts["n_train"] == 1 and opts["test_path"] is None
    assert contract_refs("arithmetic", {"digits": 2, "path": "/etc/passwd"}) == {}  # not a file option there
    assert localize_options(bucket, "r", "gsm8k", {"path": str(local)})["path"] == str(local)  # the trainer's


@pytest.mark.parametrize("kind", ["absolute", "dot-dot", "file URL", "home", "traversal in the reference"])
@pytest.mark.parametrize("command", ["worker", "eval"])
def test_worker_and_evaluator_exit_3_with_one_line_and_write_nothing(tmp_path, monkeypatch, capsys, kind, command,
                                                                     never_loaded):
    monkeypatch.setenv("STOA_CACHE", str(tmp_path / "cache"))
    url = str(tmp_path / "b")
    bucket = open_bucket(url)
    bucket.put_create(contract_key("r"), _contract({"path": REFUSED[kind]}).to_json())
    before = sorted(o.key for o in bucket.list(""))
    code = main([command, "--bucket", url, "--run", "r", "--wait-seconds", "1", "--log-dir", str(tmp_path / "logs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert (code, len(err)) == (3, 1), err
    assert "task_spec.path" in err[0] and "bucket:<sha256>/<name>" in err[0]
    assert sorted(o.key for o in bucket.list("")) == before
    assert not (tmp_path / "cache" / "task-data").exists()


HOSTILE_LINES = {
    "deep": b"[" * 100_000,
    "long integer": b'{"question": "q", "answer": "#### 2", "n": ' + b"1" * 5001 + b"}",
    "NaN": b'{"question": "q", "answer": "#### 2", "n": NaN}',
    "invalid UTF-8": b'{"question": "\xff\xfe", "answer": "#### 2"}',
    "a list": b'["q", "#### 2"]',
}
"""Lines of a data file a bucket writer could publish under its own (correct) digest with a forged contract."""


@pytest.mark.parametrize("kind", sorted(HOSTILE_LINES))
def test_referenced_data_with_a_hostile_line_is_one_line_exit_2(tmp_path, kind):
    from stoa.cli import user_error
    from stoa.retrieval import CorpusError, read_corpus
    from stoa.tasks import get_task
    from stoa.tasks.data import DataRef, TaskFile

    bucket = open_bucket(str(tmp_path / "b"))
    local = tmp_path / "train.jsonl"
    good = b'{"id": "d1", "text": "t", "question": "1 + 1?", "answer": "2\\n#### 2", "golden_answers": ["2"]}\n'
    local.write_bytes(good + HOSTILE_LINES[kind] + b"\n")  # a row every reader takes, then the hostile one
    digest = hashlib.sha256(local.read_bytes()).hexdigest()
    upload_task_files(bucket, "r", [TaskFile("path", local, DataRef(digest, "train.jsonl"))])
    spec = {"path": f"bucket:{digest}/train.jsonl"}
    for task_id in ("gsm8k", "searchqa"):
        opts = localize_contract_options(bucket, "r", task_id, spec, cache_dir=tmp_path / "cache")
        with pytest.raises(ValueError) as e:
            get_task(task_id, **opts)
        row = user_error(e.value)
        assert row is not None and row.code == 2 and "\n" not in row.line(e.value), (task_id, e.value)
        assert ":2:" in str(e.value) or kind == "a list", e.value  # names the line
    with pytest.raises(CorpusError, match=":2:"):
        list(read_corpus(local))


def test_a_hub_dataset_option_takes_a_hub_id_never_a_path():
    for value in ("/etc", "~/data", "../data", "./data", "a/b/c", "a/../b", "file:///x", "C:\\data", "", 3, ["x"]):
        with pytest.raises(TaskDataRefused, match=r"task_spec\.hf .*hub id"):
            contract_refs("gsm8k", {"hf": value})
    for value in ("openai/gsm8k", "gsm8k", "my-org/gsm8k.v2"):
        assert contract_refs("gsm8k", {"hf": value}) == {}
