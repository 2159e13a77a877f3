"""The command line: dry runs, field-named errors and exit codes."""

from __future__ import annotations

import logging
import tomllib

import pytest

from stoa.cli import main


def test_trainer_dry_run_prints_resolved_toml(capsys):
    argv = ["trainer", "--dry-run", "--run", "x", "--model", "tiny", "--algorithm", "dapo", "--algo", "eps_high=0.3"]
    assert main(argv) == 0
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
        (["local-e2e", "--groups", "0"], "groups"),
    ],
)
def test_bad_values_exit_2_naming_the_field(argv, field, capsys):
    assert main(argv) == 2
    assert field in capsys.readouterr().err


def test_env_vars_are_validated(monkeypatch, capsys):
    monkeypatch.setenv("STOA_N_SAMPLES", "-4")
    assert main(["trainer", "--dry-run"]) == 2
    assert "n_samples" in capsys.readouterr().err


def test_print_tier(capsys):
    assert main(["worker", "--print-tier"]) == 0
    out = capsys.readouterr().out
    assert "decode batch G" in out and "groups in flight" in out


def test_local_e2e_round_trip(stoa_cache, capsys):
    assert main(["local-e2e", "--groups", "2", "--n-samples", "2", "--max-new-tokens", "4", "--model", "tiny",
                 "--engine", "torch", "--task", "toy"]) == 0
    assert "2/2 records valid" in capsys.readouterr().out


def test_unreachable_bucket_is_a_clear_error(stoa_cache, capsys, monkeypatch):
    monkeypatch.setenv("STOA_BUCKET_RETRY_TIMEOUT_S", "1")
    argv = ["local-e2e", "--groups", "1", "--n-samples", "1", "--max-new-tokens", "2", "--model", "tiny",
            "--engine", "torch", "--bucket", "s3://b/p"]
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


def _help_problems(parser) -> list[str]:
    """What breaks the help conventions in one parser: a flag or subcommand without help, a default
    written another way than "[default: X]", reStructuredText markup."""
    import argparse
    import re

    problems = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            problems += [f"subcommand {a.dest} has no help" for a in action._choices_actions if not a.help]
        elif action.help is not argparse.SUPPRESS and not (action.help or "").strip():
            problems.append(f"{'/'.join(action.option_strings) or action.dest} has no help")
    out = parser.format_help()
    if re.search(r"\(default[ :]|%\(default", out):
        problems.append("a default not written as [default: X]")
    if "`" in out:
        problems.append("markup (backticks) in the help")
    return [f"{parser.prog}: {p}" for p in problems]


def test_every_subcommand_help_exits_0_in_one_style(capsys):
    """Every (sub)command's and benchmark's --help exits 0, says "usage: stoa ...", gives every flag help,
    writes defaults as [default: X] and has no markup."""
    from stoa.cli import _subparsers, build_parser
    from stoa.cli.bench import BENCHES, bench_parser

    parser = build_parser()
    paths = list(_subcommand_paths(parser)) + [("bench", name) for name in BENCHES]
    assert ("trainer",) in paths and ("local", "train") in paths and ("model", "pull") in paths
    for path in paths:
        with pytest.raises(SystemExit) as e:
            main([*path, "--help"])
        assert e.value.code == 0, path
        assert "usage: stoa" in capsys.readouterr().out, path
    parsers = [parser, *_subparsers(parser)]
    parsers += [bp for bp in map(bench_parser, BENCHES) if bp is not None]
    assert [p for parser in parsers for p in _help_problems(parser)] == []


def test_every_benchmark_has_add_arguments_so_its_help_is_checked():
    """A benchmark that built its own parser in main(argv) would escape the help check above."""
    from stoa.cli.bench import BENCHES, bench_parser

    assert [name for name in BENCHES if bench_parser(name) is None] == []


def test_version(capsys):
    from stoa import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"stoa {__version__}\n"


def test_exit_codes_are_in_the_top_level_help(capsys):
    from stoa.cli import EXIT_CODES, USER_ERRORS

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "exit codes:" in out and "STOA_DEBUG=1" in out
    for code, meaning in EXIT_CODES.items():
        assert f"  {code:<4} {meaning}" in out
    assert {row.code for row in USER_ERRORS} <= set(EXIT_CODES)


def test_global_flags_before_or_after_the_command(monkeypatch):
    from stoa.cli import build_parser

    monkeypatch.delenv("STOA_DEBUG", raising=False)
    monkeypatch.delenv("STOA_LOG_LEVEL", raising=False)
    for argv in (["--debug", "--log-level", "ERROR", "trainer"],
                 ["trainer", "--debug", "--log-level", "ERROR"],
                 ["local", "train", "--log-level", "ERROR", "--debug"]):
        args = build_parser().parse_args([*argv, "--dry-run"])
        assert args.debug is True and args.log_level == "ERROR", argv
    args = build_parser().parse_args(["--debug", "--log-level", "ERROR", "worker", "--dry-run"])
    assert args.debug is True and args.log_level == "ERROR"  # not reset by the command's parser
    args = build_parser().parse_args(["worker", "--dry-run"])
    assert args.debug is False and args.log_level == "WARNING"
    monkeypatch.setenv("STOA_DEBUG", "1")
    assert build_parser().parse_args(["worker"]).debug is True


def test_global_flags_after_a_benchmark_name_are_not_the_benchmarks(monkeypatch):
    from stoa.cli import build_parser
    from stoa.cli.bench import take_global_flags

    monkeypatch.delenv("STOA_DEBUG", raising=False)
    args = build_parser().parse_args(["bench", "trainer", "--groups", "2", "--debug", "--log-level=ERROR"])
    assert take_global_flags(args) == ["--groups", "2"]
    assert args.debug is True and args.log_level == "ERROR"
    args = build_parser().parse_args(["bench", "pulse", "--log-level", "INFO", "--steps", "1"])
    assert take_global_flags(args) == ["--steps", "1"] and args.log_level == "INFO" and args.debug is False
    logging.getLogger().setLevel(logging.WARNING)


def test_every_config_field_is_in_a_named_option_group():
    """A field no group names would fall to "advanced" unseen: each is listed or matches a group's prefix."""
    import dataclasses

    from stoa.config import LocalConfig, TrainerConfig, WorkerConfig
    from stoa.config.text import FLAG_GROUPS

    def named(name):
        return [g.key for g in FLAG_GROUPS if name in g.names or (g.prefixes and name.startswith(g.prefixes))]

    fields = {f.name for cls in (TrainerConfig, WorkerConfig, LocalConfig) for f in dataclasses.fields(cls)}
    assert {name: named(name) for name in fields if not named(name)} == {}
    assert [g.key for g in FLAG_GROUPS] == ["model", "task", "sampling", "optimizer", "fleet", "quarantine",
                                            "checkpoints", "advanced"]


@pytest.mark.parametrize("argv", [["trainer"], ["worker"], ["local", "train"]])
def test_config_commands_list_their_flags_by_group_in_a_fixed_order(argv):
    from stoa.cli import build_parser, command_parser
    from stoa.config.text import FLAG_GROUPS, flag_group

    parser = build_parser()
    command = command_parser(parser, parser.parse_args([*argv, "--dry-run"]))
    groups = [g for g in command._action_groups if g.title not in ("positional arguments", "options")]
    titles = [g.title for g in FLAG_GROUPS]
    assert [g.title for g in groups] == [t for t in titles if t in {g.title for g in groups}]
    for group in groups:
        for action in group._group_actions:
            assert flag_group(action.dest).title == group.title, action.dest
            assert action.help and "[default:" in action.help, action.dest
    assert "--set KEY=VALUE" in command.format_help() and len(command.format_usage().splitlines()) == 1


def test_the_top_level_help_lists_every_command_once_by_what_people_do(capsys):
    from stoa.cli import COMMANDS
    from stoa.cli.parser import COMMAND_GROUPS

    grouped = [n for g in COMMAND_GROUPS for n in g.names]
    assert sorted(set(COMMANDS) - set(grouped)) == [] and len(grouped) == len(set(grouped))
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    listing = out.split("commands:\n")[1].split("\n\n")[0].splitlines()
    names = [line.split()[0] for line in listing if line.startswith("    ")]
    assert names == [n for n in grouped if n in COMMANDS]  # "runs" is listed once its command is registered
    assert [line.strip() for line in listing if not line.startswith("    ")] == [
        f"{g.title}:" for g in COMMAND_GROUPS if set(g.names) & set(COMMANDS)]


@pytest.mark.parametrize(("argv", "hint"), [
    (["trainr"], "unknown command 'trainr'; did you mean 'trainer'?"),
    (["local", "trian"], "unknown action 'trian'; did you mean 'train'?"),
    (["status", "--bukcet", "b", "--run", "r"], "did you mean --bucket (you wrote --bukcet)?"),
    (["export", "out", "--bucket", "b", "--rnu", "r"], "did you mean --run (you wrote --rnu)?"),
    (["worker", "--engine", "torch", "--dry-run", "--engien", "mlx"], "did you mean --engine?"),
    (["eval", "--bucket", "b", "--run", "r", "--engine", "trch"], "did you mean 'torch'?"),
])
def test_mistyped_commands_and_required_flags_get_did_you_mean(argv, hint, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.rstrip().endswith(f"{hint} (see {err.split(':')[0]} "
                                                                                "--help)")


def test_a_bad_log_level_is_one_line_listing_the_levels(capsys):
    assert main(["trainer", "--dry-run", "--log-level", "verbose"]) == 2
    assert capsys.readouterr().err == ("stoa: invalid setting log_level: 'verbose' is not a logging level; use one "
                                       "of debug, info, warning, error, critical (--debug prints tracebacks)\n")
    args_with_level = ["bench", "pulse", "--log-level", "loud"]
    assert main(args_with_level) == 2 and "'loud' is not a logging level" in capsys.readouterr().err
    logging.getLogger().setLevel(logging.WARNING)
