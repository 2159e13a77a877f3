"""The join card: values from the contract, names of credentials (never values), the 0600 secrets file."""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path

import pytest

from stoa.bucket import open_bucket
from stoa.bucket.credentials import load_env_file
from stoa.cli import main
from stoa.join.card import CardError, card_toml, credential_names, make_card, read_card, write_secrets
from tests.join.conftest import write_run

R2_ENV = {"R2_ACCOUNT_ID": "acct123", "R2_ACCESS_KEY_ID": "r2-key-id", "R2_SECRET_ACCESS_KEY": "r2-secret-value-xyz"}


def test_the_card_file_holds_the_runs_values_and_reads_back(local_bucket, tmp_path):
    contract = write_run(open_bucket(local_bucket), "r1", n_samples=4, plane="int8g64", task="gsm8k")
    out = tmp_path / "card.toml"
    assert main(["join-card", "--bucket", local_bucket, "--run", "r1", "--out", str(out)]) == 0
    data = tomllib.loads(out.read_text())
    assert data == {"bucket": local_bucket, "run": "r1", "n_samples": 4, "plane": "int8g64", "task": "gsm8k",
                    "contract": contract.fingerprint(), "search": False, "retriever": "", "credentials": [],
                    "card_version": 1}
    assert read_card(out) == make_card(local_bucket, "r1", env={})


def test_a_relative_local_bucket_is_made_absolute_on_the_card(local_bucket, monkeypatch):
    write_run(open_bucket(local_bucket), "r1")
    monkeypatch.chdir(Path(local_bucket).parent)
    assert make_card(Path(local_bucket).name, "r1", env={}).bucket == local_bucket


def test_a_search_task_card_names_the_endpoint_or_the_bucket_index(local_bucket):
    write_run(open_bucket(local_bucket), "s1", task="search", retriever={"fingerprint": "f" * 16})
    assert make_card(local_bucket, "s1", env={}).search is True
    assert make_card(local_bucket, "s1", env={}).retriever == ""
    assert make_card(local_bucket, "s1", "http://10.0.0.5:8799", env={}).retriever == "http://10.0.0.5:8799"
    with pytest.raises(CardError, match="URL of a shared endpoint"):
        make_card(local_bucket, "s1", "/data/index", env={})


def test_a_retriever_for_a_task_without_one_is_refused(local_bucket):
    write_run(open_bucket(local_bucket), "r1", task="gsm8k")
    assert main(["join-card", "--bucket", local_bucket, "--run", "r1", "--retriever", "http://h:1"]) == 2


def test_a_missing_run_exits_12(local_bucket):
    assert main(["join-card", "--bucket", local_bucket, "--run", "nope"]) == 12


@pytest.mark.parametrize(("url", "env", "names"), [
    ("r2://b/p", R2_ENV, ("R2_ACCOUNT_ID", "R2_ACCESS_KEY_ID", "R2_SECRET_ACCESS_KEY")),
    ("r2:///p", R2_ENV, ("R2_ACCOUNT_ID", "R2_ACCESS_KEY_ID", "R2_SECRET_ACCESS_KEY", "R2_BUCKET")),
    ("r2://b/p", {**R2_ENV, "R2_ENDPOINT_URL": "http://x"},
     ("R2_ACCOUNT_ID", "R2_ACCESS_KEY_ID", "R2_SECRET_ACCESS_KEY", "R2_ENDPOINT_URL")),
    ("s3://b/p", R2_ENV, ("R2_ACCOUNT_ID", "R2_ACCESS_KEY_ID", "R2_SECRET_ACCESS_KEY")),
    ("s3://b/p", {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_ENDPOINT_URL": "http://m:9"},
     ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL")),
    ("s3://b/p", {}, ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")),
    ("/some/dir", R2_ENV, ()),
])
def test_credential_names_follow_the_url_scheme_and_this_machines_variables(url, env, names):
    assert credential_names(url, env) == names


def test_the_card_text_never_holds_a_secret_value(local_bucket):
    write_run(open_bucket(local_bucket), "r1")
    card = make_card(local_bucket, "r1", env={})
    card = card.__class__(**{**card.__dict__, "credentials": tuple(R2_ENV)})
    text = card_toml(card)
    assert tomllib.loads(text)["credentials"] == list(R2_ENV)
    assert not any(value in text for value in R2_ENV.values())


def test_the_secrets_file_is_created_0600_and_reads_back(tmp_path):
    path = tmp_path / "stoa.env"
    old = os.umask(0)  # the widest umask: the file must still be 0600
    try:
        written = write_secrets(path, tuple(R2_ENV), {**R2_ENV, "OTHER": "x"})
    finally:
        os.umask(old)
    assert written == list(R2_ENV)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_env_file(path) == R2_ENV


def test_a_value_with_quotes_and_spaces_reads_back_unchanged(tmp_path):
    env = {"R2_SECRET_ACCESS_KEY": "'a b'c\"", "R2_ACCESS_KEY_ID": '"q"'}
    write_secrets(tmp_path / "e", tuple(env), env)
    assert load_env_file(tmp_path / "e") == env


def test_the_secrets_file_is_never_overwritten_nor_written_with_a_variable_missing(tmp_path):
    path = tmp_path / "stoa.env"
    path.write_text("keep\n")
    with pytest.raises(CardError, match="exists"):
        write_secrets(path, tuple(R2_ENV), R2_ENV)
    assert path.read_text() == "keep\n"
    with pytest.raises(CardError, match="R2_SECRET_ACCESS_KEY"):
        write_secrets(tmp_path / "new.env", tuple(R2_ENV), {"R2_ACCOUNT_ID": "a", "R2_ACCESS_KEY_ID": "b"})
    assert not (tmp_path / "new.env").exists()


def test_with_secrets_for_a_local_bucket_is_refused(local_bucket, tmp_path):
    write_run(open_bucket(local_bucket), "r1")
    assert main(["join-card", "--bucket", local_bucket, "--run", "r1", "--with-secrets", str(tmp_path / "e")]) == 2
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize(("text", "match"), [
    ("card_version = 2\n", "version"),
    ("card_version = 1\nrun = 'r'\n", "'bucket' is missing"),
    ('{"card_version": 1, "bucket": "b", "run": "r", "n_samples": true}', "'n_samples'"),
    ("not toml [", "not a join card"),
])
def test_a_bad_card_is_refused_with_the_fix(tmp_path, text, match):
    (tmp_path / "c").write_text(text)
    with pytest.raises(CardError, match=match):
        read_card(tmp_path / "c")


def test_a_missing_card_file_is_refused(tmp_path):
    with pytest.raises(CardError, match="stoa join-card --out"):
        read_card(tmp_path / "absent.toml")
