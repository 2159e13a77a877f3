"""stoa join: one check per line, a refusal with the exit code of the failing check, then the worker's exec."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from stoa.bucket import open_bucket
from stoa.join import checks
from stoa.join.card import card_toml, make_card
from stoa.join.launch import JoinOptions, join, run_checks, worker_argv
from tests.join.conftest import write_run


class Recorder:
    """Stands in for exec: records the worker's command line and environment."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], dict[str, str]]] = []

    def __call__(self, argv, env) -> None:
        self.calls.append((list(argv), dict(env)))


def make_card_file(tmp_path: Path, bucket: str, run: str = "r1", **changes) -> Path:
    card = make_card(bucket, run, env={})
    card = card.__class__(**{**card.__dict__, **changes})
    path = tmp_path / f"join-{run}.toml"
    path.write_text(card_toml(card))
    return path


def run_join(opts: JoinOptions, **kw) -> tuple[int, list[str], Recorder]:
    lines: list[str] = []
    execute = Recorder()
    code = join(opts, echo=lines.append, execute=execute, platform="linux", **kw)
    return code, lines, execute


def test_every_check_passes_on_a_live_local_run(local_bucket):
    write_run(open_bucket(local_bucket), "r1", state="running")
    found = run_checks(make_card(local_bucket, "r1", env={}), {})
    assert [(c.name, c.status) for c in found] == [
        ("engine", "ok"), ("blas", "ok"), ("tier", "ok"), ("disk", "ok"), ("bucket", "ok"), ("contract", "ok"),
        ("task-code", "ok"), ("retriever", "ok")]


def test_a_dry_run_checks_and_starts_nothing(local_bucket, tmp_path):
    write_run(open_bucket(local_bucket), "r1")
    code, lines, execute = run_join(JoinOptions(card=str(make_card_file(tmp_path, local_bucket)), dry_run=True))
    assert code == 0 and execute.calls == []
    assert len([line for line in lines if line.startswith("[join] ok")]) == 8


def test_join_execs_the_worker_with_the_cards_values_and_the_env_file(local_bucket, tmp_path):
    write_run(open_bucket(local_bucket), "r1", task="search", retriever={"fingerprint": "f" * 16})
    env_file = tmp_path / "w.env"
    env_file.write_text("X=1\n")
    env_file.chmod(0o600)
    card = make_card_file(tmp_path, local_bucket)
    code, _, execute = run_join(JoinOptions(card=str(card), env_file=str(env_file), name="mac-1"))
    assert code == 0
    [(argv, env)] = execute.calls
    assert argv == [sys.executable, "-m", "stoa", "worker", "--bucket", local_bucket, "--run", "r1",
                    "--n-samples", "8", "--plane", "bf16", "--name", "mac-1"]
    assert env["STOA_ENV_FILE"] == str(env_file.resolve())


def test_a_cards_retriever_url_reaches_the_worker(local_bucket):
    write_run(open_bucket(local_bucket), "s1", task="search", retriever={"fingerprint": "f" * 16})
    card = make_card(local_bucket, "s1", "http://10.1.2.3:8799", env={})
    assert worker_argv(card)[-2:] == ["--retriever", "http://10.1.2.3:8799"]


def test_a_missing_run_is_refused_with_exit_4(local_bucket, tmp_path):
    write_run(open_bucket(local_bucket), "r1")
    card = make_card_file(tmp_path, local_bucket, run="r1")
    card.write_text(card.read_text().replace('run = "r1"', 'run = "gone"'))
    code, lines, execute = run_join(JoinOptions(card=str(card)))
    assert (code, execute.calls) == (4, [])
    assert lines[-1].startswith("[join] refused: bucket")


@pytest.mark.parametrize(("changes", "state"), [({"n_samples": 4}, None), ({"plane": "int8g64"}, None),
                                                ({"contract": "0" * 16}, None), ({}, "finished")])
def test_a_card_that_disagrees_with_the_run_or_a_finished_run_is_refused_with_exit_3(local_bucket, tmp_path,
                                                                                     changes, state):
    write_run(open_bucket(local_bucket), "r1", state=state)
    code, lines, execute = run_join(JoinOptions(card=str(make_card_file(tmp_path, local_bucket, **changes))))
    assert (code, execute.calls) == (3, [])
    assert lines[-1].startswith("[join] refused: contract")


def test_missing_credentials_are_refused_with_exit_9_before_any_request(local_bucket, tmp_path):
    write_run(open_bucket(local_bucket), "r1")
    card = make_card_file(tmp_path, local_bucket, credentials=("R2_ACCOUNT_ID", "R2_SECRET_ACCESS_KEY"))
    code, lines, _ = run_join(JoinOptions(card=str(card)))
    assert code == 9
    assert "R2_ACCOUNT_ID, R2_SECRET_ACCESS_KEY not set" in next(x for x in lines if "fail" in x)


def test_an_env_file_others_can_read_is_refused_with_exit_9(local_bucket, tmp_path):
    write_run(open_bucket(local_bucket), "r1")
    env_file = tmp_path / "w.env"
    env_file.write_text("X=1\n")
    env_file.chmod(0o644)
    code, _, execute = run_join(JoinOptions(card=str(make_card_file(tmp_path, local_bucket)), env_file=str(env_file)))
    assert (code, execute.calls) == (9, [])


def test_a_missing_engine_fails_and_the_reference_blas_warns(monkeypatch):
    assert checks.check_engine("mlx", find=lambda name: None).status == "fail"
    assert checks.check_engine("torch", find=lambda name: object()).status == "ok"
    monkeypatch.setattr(checks, "blas_status", lambda: "reference")
    assert checks.check_blas("mlx", system="Linux").status == "warn"
    assert checks.check_blas("mlx", system="Darwin").status == "ok"
    assert checks.check_blas("torch", system="Linux").status == "ok"


def test_too_little_disk_fails(tmp_path):
    assert checks.check_disk(tmp_path / "not" / "yet", min_free_gb=1e9).status == "fail"
    assert checks.check_disk(tmp_path, min_free_gb=0.0).status == "ok"


def test_the_tier_line_names_the_decode_batch(monkeypatch):
    monkeypatch.setenv("STOA_MEMORY_GB", "16")
    monkeypatch.delenv("STOA_DECODE_BATCH", raising=False)
    monkeypatch.delenv("STOA_GROUPS_IN_FLIGHT", raising=False)
    c = checks.check_tier(8)
    assert c.status == "ok" and "decode batch 16 rows (2 groups x n=8)" in c.detail


def test_a_search_run_without_index_or_endpoint_fails_and_an_unreachable_endpoint_fails(local_bucket):
    contract = write_run(open_bucket(local_bucket), "s1", task="search")
    card = make_card(local_bucket, "s1", env={})
    assert checks.check_retriever(card, contract).status == "fail"
    from tests.bucket.conftest import closed_port

    card = card.__class__(**{**card.__dict__, "retriever": f"http://127.0.0.1:{closed_port()}"})
    assert checks.check_retriever(card, contract).code == checks.EXIT_TIMEOUT


PLUGIN = {"module": "my_quiz_absent", "dist": "my-quiz", "version": "1.2", "sha256": "b" * 64}


def test_a_run_whose_task_code_is_missing_here_is_refused_with_exit_16_and_the_pip_install(local_bucket, tmp_path):
    write_run(open_bucket(local_bucket), "r1", task="my-quiz", task_code=(PLUGIN,))
    card_file = make_card_file(tmp_path, local_bucket)
    assert "requires = [\"my-quiz==1.2\"]" in card_file.read_text()
    code, lines, execute = run_join(JoinOptions(card=str(card_file)))
    assert code == 16 and execute.calls == []
    assert lines[-1] == ("[join] refused: task-code: pip install 'my-quiz==1.2' (or stoa join "
                         "--install-task-code)")


def test_install_task_code_runs_pip_with_the_cards_requirement_then_checks_again(local_bucket, tmp_path):
    write_run(open_bucket(local_bucket), "r1", task="my-quiz", task_code=(PLUGIN,))
    ran: list[list[str]] = []
    code, lines, _ = run_join(JoinOptions(card=str(make_card_file(tmp_path, local_bucket)), install_task_code=True),
                              runner=lambda argv: ran.append(list(argv)) or 0)
    assert ran == [[sys.executable, "-m", "pip", "install", "my-quiz==1.2"]]
    assert code == 16  # pip "succeeded" here but installed nothing: the second check still refuses
