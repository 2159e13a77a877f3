"""One vocabulary: canonical names everywhere, old spellings warn on one line, other tools' names get ours."""

from __future__ import annotations

import tomllib
import warnings

import pytest

from stoa.cli import main
from stoa.config import ConfigError, DeprecatedSetting, LocalConfig, TrainerConfig, WorkerConfig, load_config
from stoa.config.names import ENV_ALIASES, FOREIGN_NAMES, foreign_hint


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (*ENV_ALIASES, *ENV_ALIASES.values(), "STOA_DEBUG"):
        monkeypatch.delenv(var, raising=False)


def _dry(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, tomllib.loads(out.split("# resolved algorithm")[0]) if code == 0 else {}, err


@pytest.mark.parametrize(("old", "new", "field", "value", "want"), [
    ("DRL_RUN", "STOA_RUN", "run", "envrun", "envrun"),
    ("DRL_N_SAMPLES", "STOA_N_SAMPLES", "n_samples", "6", 6),
    ("DRL_PULSE_PLANE", "STOA_PLANE", "plane", "int8g64", "int8g64"),
])
def test_env_vars_are_stoa_and_the_old_names_still_work_with_a_warning(old, new, field, value, want):
    assert getattr(load_config(TrainerConfig, env={new: value}), field) == want
    with pytest.warns(DeprecatedSetting, match=f"^{old} is deprecated: use {new} "):
        assert getattr(load_config(WorkerConfig, env={old: value}), field) == want
    with warnings.catch_warnings():  # the new name wins and the old one is not read
        warnings.simplefilter("error")
        cfg = load_config(TrainerConfig, env={new: value, old: "other"})
    assert getattr(cfg, field) == want


def test_a_deprecated_env_var_is_one_warning_line_on_the_command_line(monkeypatch, capsys):
    monkeypatch.setenv("DRL_N_SAMPLES", "6")
    code, cfg, err = _dry(["trainer", "--dry-run", "--run", "r", "--model", "tiny"], capsys)
    assert code == 0 and cfg["n_samples"] == 6
    assert err == "stoa: warning: DRL_N_SAMPLES is deprecated: use STOA_N_SAMPLES (same meaning)\n"


@pytest.mark.parametrize(("key", "ours"), [
    ("learning_rate", "lr"), ("num_generations", "n_samples"), ("beta", "kl_beta"),
    ("max_completion_length", "max_new_tokens"), ("save_steps", "checkpoint_every"), ("max_steps", "steps"),
    ("model_name_or_path", "model"), ("gradient_accumulation_steps", "groups_per_step"),
    ("per_device_train_batch_size", "micro_batch"), ("kl_loss_coef", "kl_beta"),
])
def test_trl_and_verl_names_in_toml_get_ours(tmp_path, key, ours):
    f = tmp_path / "t.toml"
    f.write_text(f"{key} = 1\n")
    for cls in (TrainerConfig, LocalConfig):
        with pytest.raises(ConfigError, match=f"^{key}: unknown setting in .*; did you mean '{ours}'\\?"):
            load_config(cls, toml_path=str(f), env={})


def test_every_foreign_name_points_at_a_setting_we_have():
    from dataclasses import fields

    ours = {f.name for cls in (TrainerConfig, WorkerConfig, LocalConfig) for f in fields(cls)}
    assert {name.ours.split(".")[0] for name in FOREIGN_NAMES.values()} <= ours
    assert not set(FOREIGN_NAMES) & ours  # a name of ours is never "another tool's"


def test_a_foreign_name_is_only_suggested_where_the_command_has_ours():
    assert foreign_hint("learning_rate", {"lr"}) and not foreign_hint("learning_rate", {"n_samples"})
    assert foreign_hint("--max-steps", None, flag=True).startswith("; did you mean --steps? (--max-steps is TRL")


@pytest.mark.parametrize(("argv", "hint"), [
    (["trainer", "--learning-rate", "1e-3"], "did you mean --lr? (--learning-rate is TRL's name)"),
    (["local", "train", "--num-generations", "4"], "did you mean --n-samples? (--num-generations is TRL's"),
    (["trainer", "--max_completion_length", "9"], "did you mean --max-new-tokens?"),
    (["local", "train", "--save-steps", "5"], "did you mean --checkpoint-every?"),
    (["trainer", "--epsilon", "0.1"], "did you mean --algo eps_low=...?"),
])
def test_trl_names_as_flags_get_ours(argv, hint, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--dry-run"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and hint in err.splitlines()[-1]


def test_set_takes_any_setting_by_its_config_name(capsys):
    code, cfg, err = _dry(["trainer", "--dry-run", "--run", "r", "--model", "tiny", "--set", "lr=1e-3",
                           "--set", "n_samples=4", "--set", "algo.eps_high=0.3", "--algo", "eps_low=0.1"], capsys)
    assert code == 0 and err == ""
    assert cfg["lr"] == 1e-3 and cfg["n_samples"] == 4 and cfg["algo"] == {"eps_high": 0.3, "eps_low": 0.1}
    code, cfg, _ = _dry(["local", "train", "--dry-run", "--set", "lora_rank=4", "--set", "max-new-tokens=9"],
                        capsys)
    assert code == 0 and cfg["lora_rank"] == 4 and cfg["max_new_tokens"] == 9


@pytest.mark.parametrize(("argv", "line"), [
    (["--set", "lr"], "stoa: invalid setting set: expected KEY=VALUE, got 'lr'"),
    (["--set", "learning_rate=1"], "stoa: invalid setting learning_rate: unknown setting given with --set; did you "
                                   "mean 'lr'? (learning_rate is TRL's name)"),
    (["--lr", "1e-3", "--set", "lr=2e-3"], "stoa: invalid setting lr: given twice, as --lr and as --set lr; keep one"),
    (["--algo", "eps_low=0.1", "--set", "algo.eps_low=0.2"],
     "stoa: invalid setting algo.eps_low: given twice, as --algo eps_low=... and as --set algo.eps_low; keep one"),
    (["--set", "lr.x=1"], "stoa: invalid setting lr.x: unknown setting given with --set; did you mean 'lr'?"),
])
def test_a_bad_set_is_one_line_exit_2(argv, line, capsys, tmp_path):
    code = main(["trainer", "--dry-run", "--run", "r", "--bucket", str(tmp_path / "b"), *argv])
    assert (code, capsys.readouterr().err) == (2, line + "\n")
    assert not (tmp_path / "b").exists()


def test_old_flag_spellings_warn_once_on_one_line_and_mean_the_same(capsys):
    code, cfg, err = _dry(["local", "train", "--dry-run", "--group-size", "4", "--beta", "0.5"], capsys)
    assert code == 0 and cfg["n_samples"] == 4 and cfg["kl_beta"] == 0.5
    assert err.splitlines() == ["stoa: warning: --beta is deprecated: use --kl-beta (same meaning)",
                                "stoa: warning: --group-size is deprecated: use --n-samples (same meaning)"]


def test_eval_flags_are_eval_n_and_eval_k_with_the_old_ones_kept(monkeypatch, capsys):
    seen = []

    from stoa.evaluator import EvalSummary

    def fake(cfg, echo):
        seen.append((cfg.n, cfg.k, cfg.dtype))
        return EvalSummary(evaluated=[1])

    monkeypatch.setattr("stoa.cli.eval.run_evaluator", fake)
    assert main(["eval", "--bucket", "b", "--run", "r", "--eval-n", "8", "--eval-k", "2", "--dtype", "bfloat16"]) == 0
    assert main(["eval", "--bucket", "b", "--run", "r", "--n", "9", "--k", "3"]) == 0
    assert seen == [(8, 2, "bfloat16"), (9, 3, "auto")]
    assert "stoa: warning: --n is deprecated: use --eval-n (same meaning)" in capsys.readouterr().err


def test_eval_dtype_values_are_the_config_ones(capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "--bucket", "b", "--run", "r", "--dtype", "bf16"])
    assert e.value.code == 2 and "invalid choice: 'bf16'" in capsys.readouterr().err


def test_bench_flags_use_the_config_names_and_keep_the_old_ones():
    from stoa.cli.bench import bench_parser

    for name, samples, tokens in (("rollout", 8, 128), ("logprobs", 4, 64)):
        parser = bench_parser(name)
        assert parser is not None
        args = parser.parse_args([])
        assert (args.samples, args.tokens) == (samples, tokens)
        args = parser.parse_args(["--n-samples", "3", "--max-new-tokens", "7"])
        assert (args.samples, args.tokens) == (3, 7)
        with pytest.warns(DeprecatedSetting, match="^--samples is deprecated: use --n-samples"):
            args = parser.parse_args(["--samples", "5", "--tokens", "6"])
        assert (args.samples, args.tokens) == (5, 6)


def test_local_e2e_positionals_and_model_env_are_deprecated(monkeypatch, capsys):
    from stoa.cli import build_parser
    from stoa.cli.local_e2e import model_from_env, shape

    args = build_parser().parse_args(["local-e2e", "--groups", "2", "--n-samples", "3", "--max-new-tokens", "5"])
    assert shape(args) == {"groups": 2, "n_samples": 3, "max_new_tokens": 5}
    with pytest.warns(DeprecatedSetting, match="positionals GROUPS SAMPLES TOKENS are deprecated"):
        assert shape(build_parser().parse_args(["local-e2e", "2", "3"])) == {"groups": 2, "n_samples": 3,
                                                                              "max_new_tokens": 256}
    with pytest.warns(DeprecatedSetting), pytest.raises(ConfigError, match="given twice"):
        shape(build_parser().parse_args(["local-e2e", "2", "--groups", "3"]))
    assert model_from_env({"STOA_MODEL": "a", "MODEL": "b"}) == "a"
    with pytest.warns(DeprecatedSetting, match="^MODEL is deprecated: use STOA_MODEL"):
        assert model_from_env({"MODEL": "b"}) == "b"
