"""A join card of a signed run carries its own worker key: ``stoa join-card`` issues a fresh one per card and writes
the card 0600 (a secret), ``stoa join`` installs the key and starts the worker with it; ``--no-worker-key`` opts out."""

from __future__ import annotations

import json
import stat

import pytest

from stoa.bucket import open_bucket
from stoa.cli import main
from stoa.identity import IdentityBook, load_worker_key
from stoa.join.card import CardError, read_card
from stoa.join.cardkey import installed_key_path
from stoa.join.launch import JoinOptions
from stoa.weights.signing import create_key, key_path
from tests.join.conftest import write_run
from tests.join.test_join import run_join


@pytest.fixture
def signed(local_bucket, tmp_path, monkeypatch):
    """A running signed run "r1"; the run key where the operator's stoa finds it; the cwd in tmp_path."""
    monkeypatch.setenv("STOA_KEY_DIR", str(tmp_path / "operator-keys"))
    monkeypatch.chdir(tmp_path)
    signer = create_key(key_path(local_bucket, "r1"))
    write_run(open_bucket(local_bucket), "r1", task="toy", state="running", signer=signer)
    return local_bucket, signer


def _book(url: str, signer) -> IdentityBook:
    book = IdentityBook(open_bucket(url), "r1", signer.public_hex)
    book.refresh()
    return book


def test_a_card_carries_a_fresh_key_and_join_installs_it_for_the_worker(signed, tmp_path, monkeypatch, capsys):
    url, signer = signed
    assert main(["join-card", "--bucket", url, "--run", "r1", "--out", "card.toml", "--name", "mac-1"]) == 0
    assert "SECRET" in capsys.readouterr().out and stat.S_IMODE((tmp_path / "card.toml").stat().st_mode) == 0o600
    card = read_card(tmp_path / "card.toml")
    assert card.worker == "mac-1" and {st.worker for st in _book(url, signer).keys.values()} == {"mac-1"}
    assert main(["join-card", "--bucket", url, "--run", "r1", "--out", "card.toml"]) == 2  # never overwritten
    monkeypatch.setenv("STOA_KEY_DIR", str(tmp_path / "mac-keys"))  # the joining machine
    code, lines, execute = run_join(JoinOptions(card="card.toml", dry_run=True))
    assert code == 0 and not installed_key_path(card).exists() and "would install" in "\n".join(lines)
    for refused in (JoinOptions(card="card.toml", worker_key="k.key"), JoinOptions(card="card.toml", name="bob")):
        assert run_join(refused)[0] == 2
    for _ in range(2):  # joining again with the same card keeps the installed key
        code, _, execute = run_join(JoinOptions(card="card.toml", name="mac-1"))
        assert code == 0
    path = installed_key_path(card)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    argv = execute.calls[0][0]
    assert argv[argv.index("--worker-key") + 1] == str(path)
    assert load_worker_key(path, "r1", "mac-1").public_hex in _book(url, signer).keys  # an identity the run vouches
    home = tmp_path / "home"  # the service runs the worker with the installed key, and holds no key itself
    assert run_join(JoinOptions(card="card.toml", install=True), home=home, runner=lambda _: 0)[0] == 0
    unit = (home / ".config/systemd/user/stoa-worker-r1.service").read_text()
    assert f"--worker-key {path}" in unit and card.worker_key not in unit


def test_count_writes_one_card_per_machine_each_with_its_own_key(signed, tmp_path):
    url, signer = signed
    assert main(["join-card", "--bucket", url, "--run", "r1", "--out", "join.toml", "--name", "mac", "--count",
                 "3"]) == 0
    cards = [read_card(tmp_path / f"join-mac-{i}.toml") for i in (1, 2, 3)]
    assert [c.worker for c in cards] == ["mac-1", "mac-2", "mac-3"]
    assert len({c.worker_key for c in cards}) == 3 and len(_book(url, signer).keys) == 3


def test_opting_out_and_a_machine_without_the_run_key(signed, tmp_path, capsys):
    url, signer = signed
    assert main(["join-card", "--bucket", url, "--run", "r1", "--out", "plain.toml", "--no-worker-key"]) == 0
    assert "--no-worker-key" in capsys.readouterr().out  # the opt-out is said
    assert read_card(tmp_path / "plain.toml").worker_key == "" and not _book(url, signer).keys
    assert main(["join-card", "--bucket", url, "--run", "r1", "--no-worker-key", "--count", "2"]) == 2
    assert main(["join-card", "--bucket", url, "--run", "r1"]) == 0  # a printed card: no secret on the screen
    out = capsys.readouterr().out
    assert "no worker key in a printed card" in out and "worker_key =" not in out
    capsys.readouterr()
    assert main(["join-card", "--bucket", url, "--run", "r1", "--out", "c.toml", "--run-key", "nope"]) == 3
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--no-worker-key" in err and not (tmp_path / "c.toml").exists()


@pytest.mark.parametrize(("worker", "key"), [("mac-1", "ab" * 31), ("mac-1", "AB" * 32), ("mac-1", 7),
                                             ("mac-1", "g" * 64), ("", "ab" * 32)])
def test_a_card_with_a_malformed_worker_key_is_refused_by_name(tmp_path, worker, key):
    data = {"card_version": 1, "bucket": "b", "run": "r", "n_samples": 2, "plane": "bf16", "task": "toy",
            "contract": "c", "search": False, "retriever": "", "credentials": [], "worker": worker, "worker_key": key}
    (tmp_path / "c.json").write_text(json.dumps(data))
    with pytest.raises(CardError, match="'worker_key'"):
        read_card(tmp_path / "c.json")
