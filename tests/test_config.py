"""Config loading: precedence, validation errors that name the field, dry-run rendering, shared files."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from stoa.config import (
    ConfigError,
    DeprecatedSetting,
    TrainerConfig,
    WorkerConfig,
    config_to_toml,
    load_config,
    load_local_config,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_defaults_validate():
    cfg = load_config(TrainerConfig, env={})
    assert cfg.n_samples == 8 and cfg.staleness_bound == 3 and cfg.reuse_cap == 2
    assert cfg.algo_config().kl_beta == 0.001
    assert load_config(TrainerConfig, overrides={"algorithm": "dapo"}, env={}).algo_config().kl_beta == 0.0
    load_config(WorkerConfig, env={})


def test_precedence_toml_env_flags(tmp_path):
    f = tmp_path / "t.toml"
    f.write_text('run = "fromtoml"\nlr = 2e-5\nn_samples = 4\n[algo]\neps_high = 0.3\n')
    env = {"STOA_N_SAMPLES": "6", "STOA_PLANE": "int8g64"}
    cfg = load_config(TrainerConfig, toml_path=str(f), env=env, overrides={"run": "fromflag", "lr": None})
    assert cfg.run == "fromflag" and cfg.lr == 2e-5 and cfg.n_samples == 6 and cfg.plane == "int8g64"
    assert cfg.algo == {"eps_high": 0.3}


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"plane": "fp8"}, "plane"),
        ({"n_samples": "1"}, "n_samples"),
        ({"n_samples": "x"}, "n_samples"),
        ({"run": "bad/name"}, "run"),
        ({"lr": "-1"}, "lr"),
        ({"top_p": "0"}, "top_p"),
        ({"keep_versions": "2"}, "keep_versions"),
        ({"device": "tpu"}, "device"),
        ({"reuse_cap": "0"}, "reuse_cap"),
        ({"nonsense": "1"}, "nonsense"),
    ],
)
def test_errors_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        load_config(TrainerConfig, overrides=overrides, env={})
    assert e.value.field == field
    assert str(e.value).startswith(field)


def test_env_var_validated():
    with pytest.raises(ConfigError) as e:
        load_config(TrainerConfig, env={"STOA_N_SAMPLES": "lots"})
    assert e.value.field == "n_samples"


def test_unknown_toml_key_refused(tmp_path):
    f = tmp_path / "t.toml"
    f.write_text("learning_rate = 1\n")
    with pytest.raises(ConfigError, match="learning_rate"):
        load_config(TrainerConfig, toml_path=str(f), env={})
    f.write_text("lr = [\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(TrainerConfig, toml_path=str(f), env={})


def test_worker_validation():
    with pytest.raises(ConfigError) as e:
        load_config(WorkerConfig, overrides={"engine": "tpu"}, env={})
    assert e.value.field == "engine"


def test_dry_run_rendering_is_valid_toml_and_round_trips(tmp_path):
    cfg = load_config(TrainerConfig, overrides={"algo": {"eps_high": 0.28}, "run": "x"}, env={})
    text = config_to_toml(cfg)
    assert tomllib.loads(text)["algo"] == {"eps_high": 0.28}
    f = tmp_path / "c.toml"
    f.write_text(text)
    assert load_config(TrainerConfig, toml_path=str(f), env={}) == cfg


# ----- one file for every command, values given twice, unknown keys -------------------------------------

SHARED = """\
bucket = "s3://b/p"
run = "shared"
n_samples = 4
lr = 3e-6

[algo]
eps_high = 0.3

[trainer]
groups_per_step = 2

[worker]
engine = "torch"
seed = 7

[local]
backend = "torch"
"""


def test_one_sectioned_file_for_trainer_worker_and_local(tmp_path):
    f = tmp_path / "fleet.toml"
    f.write_text(SHARED)
    trainer = load_config(TrainerConfig, toml_path=str(f), env={})
    worker = load_config(WorkerConfig, toml_path=str(f), env={})
    local = load_local_config(str(f))
    assert (trainer.bucket, trainer.run, trainer.n_samples) == (worker.bucket, worker.run, worker.n_samples)
    assert (trainer.lr, trainer.groups_per_step, trainer.algo) == (3e-6, 2, {"eps_high": 0.3})
    assert (worker.engine, worker.seed) == ("torch", 7)  # the worker skips the trainer's top-level lr/[algo]
    assert (local.backend, local.lr, local.groups_per_step) == ("torch", 3e-6, 2)  # bucket/run skipped


def test_a_flat_file_keeps_refusing_another_commands_key(tmp_path):
    f = tmp_path / "worker.toml"
    f.write_text("lr = 1e-5\n")
    with pytest.raises(ConfigError, match=r"^lr: unknown setting in .*belongs to \[local\] and \[trainer\]"):
        load_config(WorkerConfig, toml_path=str(f), env={})


@pytest.mark.parametrize(("text", "field", "hint"), [
    ("n_sample = 4\n", "n_sample", "did you mean 'n_samples'?"),
    ("[worker]\nengin = 'torch'\n", "engin", "in [worker] of"),
    ("[wroker]\nengine = 'torch'\n[trainer]\nlr = 1e-5\n", "wroker", "did you mean 'worker'?"),
    ("[trainer]\nstaleness = 2\n", "staleness", "did you mean 'staleness_bound'?"),
])
def test_unknown_keys_suggest_the_closest_name(tmp_path, text, field, hint):
    f = tmp_path / "t.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(WorkerConfig, toml_path=str(f), env={})  # the worker checks [trainer]'s keys too
    assert e.value.field == field and hint in str(e.value), str(e.value)


@pytest.mark.parametrize("given", ["echo_alpha", "gigpo-gamma"])
def test_an_algorithm_knob_given_as_a_setting_names_its_algo_spelling(tmp_path, given):
    knob = given.replace("-", "_")
    with pytest.raises(ConfigError) as e:
        load_config(TrainerConfig, env={}, overrides={"bucket": str(tmp_path), "run": "r", given: 0.5})
    want = f"algo.{knob} (--set algo.{knob}=V, or {knob} in the [algo] table)"
    assert e.value.field == given and want in str(e.value)
    assert "did you mean" not in str(e.value)  # echo_alpha is close to lora_alpha, which is not what was meant


def test_a_key_both_shared_and_in_the_section_is_an_error(tmp_path):
    f = tmp_path / "t.toml"
    f.write_text("seed = 1\n[worker]\nseed = 2\n")
    with pytest.raises(ConfigError, match=f"^seed: given twice, as seed in {f} and as \\[worker\\] seed in"):
        load_config(WorkerConfig, toml_path=str(f), env={})
    load_config(TrainerConfig, toml_path=str(f), env={})  # the trainer sees seed once


@pytest.mark.parametrize(("toml", "argv", "places"), [
    ("[algo]\nkl_beta = 0.2\n", ["--kl-beta", "0.1"], "as --kl-beta and as [algo] kl_beta in {f}"),
    ("kl_beta = 0.1\n[algo]\nkl_beta = 0.2\n", [], "as kl_beta in {f} and as [algo] kl_beta in {f}"),
    ("[trainer]\nkl_beta = 0.1\n[trainer.algo]\nkl_beta = 0.2\n", [],
     "as [trainer] kl_beta in {f} and as [trainer.algo] kl_beta in {f}"),
    ("", ["--kl-beta", "0.1", "--algo", "kl_beta=0.2"], "as --kl-beta and as --algo kl_beta=..."),
])
def test_trainer_kl_beta_given_twice_names_both_places(tmp_path, capsys, toml, argv, places):
    from stoa.cli import main

    f = tmp_path / "t.toml"
    f.write_text(toml)
    assert main(["trainer", "--dry-run", "--config", str(f), *argv]) == 2
    assert f"kl_beta: given twice, {places.format(f=f)}; keep one" in capsys.readouterr().err


def test_algo_knobs_owned_by_a_setting_are_refused(tmp_path):
    f = tmp_path / "t.toml"
    f.write_text("[algo]\ntemperature = 0.5\n")
    with pytest.raises(ConfigError, match=r"^algo.temperature: \[algo\] temperature in .* 'temperature' "):
        load_config(TrainerConfig, toml_path=str(f), env={})
    with pytest.raises(ConfigError, match="^algo.max_tokens: --algo max_tokens=... duplicates the 'max_new"):
        load_config(TrainerConfig, overrides={"algo": {"max_tokens": 8}}, env={})
    cfg = TrainerConfig(kl_beta=0.1, algo={"kl_beta": 0.2})  # built directly: algo_config still refuses it
    with pytest.raises(ConfigError, match=r"^kl_beta: given twice, as kl_beta and as \[algo\] kl_beta"):
        cfg.algo_config()


def test_fleet_example_serves_trainer_and_worker():
    trainer = load_config(TrainerConfig, toml_path=str(EXAMPLES / "fleet-smollm2-arithmetic.toml"), env={})
    worker = load_config(WorkerConfig, toml_path=str(EXAMPLES / "fleet-smollm2-arithmetic.toml"), env={})
    assert (trainer.run, trainer.n_samples, trainer.model) == (worker.run, worker.n_samples, "smollm2-135m")
    assert worker.model == ""


@pytest.mark.parametrize("name", ["smollm2-135m-arithmetic.toml", "qwen3-0.6b-arithmetic.toml"])
def test_local_examples_use_the_current_names(name, recwarn):
    cfg = load_local_config(str(EXAMPLES / name))
    assert cfg.n_samples == 8 and not [w for w in recwarn if issubclass(w.category, DeprecatedSetting)]
