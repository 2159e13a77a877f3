"""``stoa worker-key issue|list|revoke`` and ``stoa join --worker-key`` (a key file handed over apart)."""

from __future__ import annotations

import json
import stat
from dataclasses import replace

import pytest

from stoa.bucket import open_bucket
from stoa.cli import main
from stoa.contract import ModelSpec, RunContract, RunKeyError, SamplingSpec
from stoa.identity import IdentityBook, load_worker_key, note_worker_key
from stoa.join.card import card_toml, read_card
from stoa.join.launch import JoinOptions, join, worker_argv
from stoa.layout import contract_key
from stoa.weights.signing import create_key, key_path


def contract(run: str = "r") -> RunContract:
    return RunContract(run_id=run, model=ModelSpec("llama", "c", "t", vocab_size=512, eos_token_ids=(2,)),
                       n_samples=2, plane="bf16", task_id="toy", task_spec={}, reward_version="1",
                       sampling=SamplingSpec(1.0, 1.0, 8))


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A signed run "r" and an unsigned run "plain" in a local bucket; the run key at the trainer's path."""
    monkeypatch.setenv("STOA_KEY_DIR", str(tmp_path / "keys"))
    monkeypatch.chdir(tmp_path)
    url = str(tmp_path / "b")
    bucket = open_bucket(url)
    signer = create_key(key_path(url, "r"))
    bucket.put_create(contract_key("r"), signer.sign_contract(contract()).to_json())
    bucket.put_create(contract_key("plain"), contract("plain").to_json())
    return url, bucket, signer


def test_issue_list_revoke(run, tmp_path, capsys):
    url, bucket, signer = run
    assert main(["worker-key", "issue", "alice", "--bucket", url, "--run", "r"]) == 0
    key = load_worker_key(tmp_path / "worker-r-alice.key", "r")
    assert stat.S_IMODE((tmp_path / "worker-r-alice.key").stat().st_mode) == 0o600
    assert main(["worker-key", "issue", "alice", "--bucket", url, "--run", "r"]) == 2  # the file exists
    assert main(["worker-key", "issue", "bob", "--bucket", url, "--run", "r", "--out", "bob.key"]) == 0
    book = IdentityBook(bucket, "r", signer.public_hex)
    book.refresh()
    assert {st.worker for st in book.keys.values()} == {"alice", "bob"} and key.public_hex in book.keys
    assert main(["worker-key", "revoke", "alice", "--bucket", url, "--run", "r"]) == 0
    assert main(["worker-key", "revoke", "alice", "--bucket", url, "--run", "r"]) == 2  # nothing left in force
    capsys.readouterr()
    assert main(["worker-key", "list", "--bucket", url, "--run", "r", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {(r["name"], r["status"]) for r in rows} == {("alice", "revoked"), ("bob", "valid")}


def test_issue_is_refused_by_name_without_the_runs_key(run, tmp_path, capsys):
    url, _, _ = run
    for argv, code in ((["issue", "a", "--run", "plain"], 3),  # a run without a run key
                       (["issue", "a", "--run", "r", "--run-key", str(tmp_path / "nope")], 3),
                       (["issue", "a", "--run", "r", "--run-key", str(create_key(tmp_path / "other").path)], 3),
                       (["issue", "a-", "--run", "r"], 2), (["issue", "a", "--run", "gone"], 12)):
        capsys.readouterr()
        assert main(["worker-key", *argv, "--bucket", url]) == code, argv
        assert len(capsys.readouterr().err.strip().splitlines()) == 1, argv
    assert not list(tmp_path.glob("worker-*.key"))


def test_a_key_file_handed_over_apart_reaches_the_worker(run, tmp_path):
    url, _, _ = run
    assert main(["worker-key", "issue", "alice", "--bucket", url, "--run", "r"]) == 0
    assert main(["join-card", "--bucket", url, "--run", "r", "--out", "card.toml", "--no-worker-key"]) == 0
    card = read_card(tmp_path / "card.toml")
    assert card.worker == card.worker_key == "" and "private" not in (tmp_path / "card.toml").read_text()
    argv = worker_argv(card, worker_key=str(tmp_path / "worker-r-alice.key"))
    assert argv[-2:] == ["--worker-key", str(tmp_path / "worker-r-alice.key")]
    assert load_worker_key(argv[-1], "r").worker == "alice"
    lines: list[str] = []  # a card of an older stoa: it names the worker, whose key file travels apart
    named = tmp_path / "named.toml"
    named.write_text(card_toml(replace(card, worker="alice")))
    assert join(JoinOptions(card=str(named), dry_run=True), echo=lines.append) == 2 and "--worker-key FILE" in lines[-1]


def test_the_worker_takes_its_name_from_its_key_and_refuses_a_revoked_one(run, tmp_path):
    url, bucket, signer = run
    assert main(["worker-key", "issue", "alice", "--bucket", url, "--run", "r"]) == 0
    path = tmp_path / "worker-r-alice.key"
    key = load_worker_key(path, "r", "alice")
    with pytest.raises(RunKeyError, match="the key names the worker"):
        load_worker_key(path, "r", "bob")
    lines: list[str] = []
    note_worker_key(bucket, "r", signer.public_hex, key, lines.append)
    assert lines[-1].endswith("identity valid)")
    note_worker_key(bucket, "r", signer.public_hex, None, lines.append)
    assert "records go unsigned" in lines[-1]
    assert main(["worker-key", "revoke", "alice", "--bucket", url, "--run", "r"]) == 0
    with pytest.raises(RunKeyError, match="is revoked in run 'r'"):
        note_worker_key(bucket, "r", signer.public_hex, key, lines.append)
