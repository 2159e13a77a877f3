"""The command line: dry runs, field-named errors and exit codes."""

from __future__ import annotations

import tomllib

import pytest

from stoa.cli import main


def test_trainer_dry_run_prints_resolved_toml(capsys):
    assert main(["trainer", "--dry-run", "--run", "x", "--algorithm", "dapo", "--algo", "eps_high=0.3"]) == 0
    out = capsys.readouterr().out
    cfg = tomllib.loads(out.split("# resolved algorithm")[0])
    assert cfg["run"] == "x" and cfg["algorithm"] == "dapo" and cfg["algo"] == {"eps_high": 0.3}
    assert "# kl_beta = 0.0" in out  # DAPO's preset shows in the resolved algorithm


@pytest.mark.parametrize(
    "argv,field",
    [
        (["trainer", "--dry-run", "--n-samples", "zero"], "n_samples"),
        (["trainer", "--dry-run", "--plane", "fp4"], "plane"),
        (["trainer", "--dry-run", "--algorithm", "ppo2"], "algorithm"),
        (["trainer", "--dry-run", "--algo", "eps_low=-1"], "eps_low"),
        (["worker", "--dry-run", "--engine", "tpu"], "engine"),
        (["quickstart", "--workers", "0"], "workers"),
        (["local-e2e", "0"], "groups"),
    ],
)
def test_bad_values_exit_2_naming_the_field(argv, field, capsys):
    assert main(argv) == 2
    assert field in capsys.readouterr().err


def test_env_vars_are_validated(monkeypatch, capsys):
    monkeypatch.setenv("DRL_N_SAMPLES", "-4")
    assert main(["trainer", "--dry-run"]) == 2
    assert "n_samples" in capsys.readouterr().err


def test_print_tier(capsys):
    assert main(["worker", "--print-tier"]) == 0
    out = capsys.readouterr().out
    assert "decode batch G" in out and "groups in flight" in out


def test_local_e2e_round_trip(stoa_cache, capsys):
    assert main(["local-e2e", "2", "2", "4", "--model", "tiny", "--engine", "torch", "--task", "toy"]) == 0
    assert "2/2 records valid" in capsys.readouterr().out


def test_unreachable_bucket_is_a_clear_error(stoa_cache, capsys, monkeypatch):
    monkeypatch.setenv("STOA_BUCKET_RETRY_TIMEOUT_S", "1")
    argv = ["local-e2e", "1", "1", "2", "--model", "tiny", "--engine", "torch",
            "--bucket", "s3://b/p"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret-value-123")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert main(argv) == 4
    err = capsys.readouterr().err
    assert "unreachable" in err and "s3://b/p" in err and "nothing was written" in err
    assert "very-secret-value-123" not in err


def _subcommand_paths(parser, prefix=()):
    """Every (sub)command path of an argparse parser, e.g. ('local', 'train')."""
    import argparse

    yield prefix
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommand_paths(sub, (*prefix, name))


def test_every_subcommand_help_exits_0(capsys):
    from stoa.cli import build_parser
    from stoa.cli.bench import BENCHES

    paths = list(_subcommand_paths(build_parser())) + [("bench", name) for name in BENCHES]
    assert ("trainer",) in paths and ("local", "train") in paths and ("model", "pull") in paths
    for path in paths:
        with pytest.raises(SystemExit) as e:
            main([*path, "--help"])
        assert e.value.code == 0, path
        assert "usage: stoa" in capsys.readouterr().out, path
