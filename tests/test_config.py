"""Config loading: precedence, validation errors that name the field, dry-run rendering."""

from __future__ import annotations

import tomllib

import pytest

from stoa.config import ConfigError, TrainerConfig, WorkerConfig, config_to_toml, load_config


def test_defaults_validate():
    cfg = load_config(TrainerConfig, env={})
    assert cfg.n_samples == 8 and cfg.staleness_bound == 3 and cfg.reuse_cap == 2
    assert cfg.algo_config().kl_beta == 0.001
    assert load_config(TrainerConfig, overrides={"algorithm": "dapo"}, env={}).algo_config().kl_beta == 0.0
    load_config(WorkerConfig, env={})


def test_precedence_toml_env_flags(tmp_path):
    f = tmp_path / "t.toml"
    f.write_text('run = "fromtoml"\nlr = 2e-5\nn_samples = 4\n[algo]\neps_high = 0.3\n')
    cfg = load_config(TrainerConfig, toml_path=str(f), env={"DRL_N_SAMPLES": "6", "DRL_PULSE_PLANE": "int8g64"},
                      overrides={"run": "fromflag", "lr": None})
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
        load_config(TrainerConfig, env={"DRL_N_SAMPLES": "lots"})
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
