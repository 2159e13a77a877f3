"""AlgoConfig: presets, round trips, and ValueErrors that name the offending field."""

from __future__ import annotations

import math

import pytest

from stoa.algorithms import ALGORITHM_NAMES, PRESETS, AlgoConfig, get_algorithm

BAD: list[tuple[dict, str]] = [
    ({"name": "ppo"}, "name"),
    ({"name": "grpo", "eps_lo": 0.1}, "eps_lo"),
    ({"name": "grpo", "eps_low": -0.1}, "eps_low"),
    ({"name": "grpo", "eps_low": 1.5}, "eps_low"),
    ({"name": "grpo", "eps_low": True}, "eps_low"),
    ({"name": "grpo", "eps_high": 0.0}, "eps_high"),
    ({"name": "grpo", "eps_high": math.nan}, "eps_high"),
    ({"name": "grpo", "dual_clip_c": 1.0}, "dual_clip_c"),
    ({"name": "grpo", "dual_clip_c": "3"}, "dual_clip_c"),
    ({"name": "grpo", "gate": "trust"}, "gate"),
    ({"name": "grpo", "gate_delta_low": -0.1}, "gate_delta_low"),
    ({"name": "grpo", "gate": "tv", "gate_delta_high": 1.5}, "gate_delta_high"),
    ({"name": "grpo", "tis_cap": 0.0}, "tis_cap"),
    ({"name": "grpo", "tis_cap": math.inf}, "tis_cap"),
    ({"name": "grpo", "kl_beta": -0.001}, "kl_beta"),
    ({"name": "grpo", "kl_estimator": "k4"}, "kl_estimator"),
    ({"name": "grpo", "adv_std_norm": "yes"}, "adv_std_norm"),
    ({"name": "grpo", "max_tokens": 0}, "max_tokens"),
    ({"name": "grpo", "max_tokens": 2.5}, "max_tokens"),
    ({"name": "grpo", "overlong_buffer": -1}, "overlong_buffer"),
    ({"name": "grpo", "overlong_penalty": -1.0}, "overlong_penalty"),
    ({"name": "grpo", "temperature": 0.0}, "temperature"),
    ({"name": "grpo", "temperature": math.inf}, "temperature"),
    ({"name": "gspo", "gspo_eps_low": 0.0}, "gspo_eps_low"),
    ({"name": "gspo", "gspo_eps_high": -1e-4}, "gspo_eps_high"),
    ({"name": "cispo", "cispo_eps_high": 0.0}, "cispo_eps_high"),
    ({"name": "gigpo", "gigpo_omega": -0.5}, "gigpo_omega"),
    ({"name": "gigpo", "gigpo_omega": "1"}, "gigpo_omega"),
    ({"name": "gigpo", "gigpo_gamma": 1.01}, "gigpo_gamma"),
    ({"name": "gigpo", "gigpo_gamma": -0.1}, "gigpo_gamma"),
    ({"name": "grpo", "echo_alpha": -0.1}, "echo_alpha"),
    ({"name": "grpo", "echo_alpha": math.inf}, "echo_alpha"),
    ({"name": "grpo", "echo_schedule": "cosine"}, "echo_schedule"),
    # contradictions
    ({"name": "dr_grpo"}, "max_tokens"),
    ({"name": "dr_grpo", "max_tokens": 8, "adv_std_norm": True}, "adv_std_norm"),
    ({"name": "rloo", "adv_std_norm": True}, "adv_std_norm"),
    ({"name": "gspo", "gate": "tv"}, "gate"),
    ({"name": "cispo", "dual_clip_c": 3.0}, "dual_clip_c"),
    ({"name": "cispo", "tis_cap": 2.0}, "tis_cap"),
    ({"name": "grpo", "gate": "none", "gate_delta_low": 0.1}, "gate_delta_low"),
    ({"name": "dapo", "overlong_buffer": 4}, "max_tokens"),
    ({"name": "dapo", "overlong_buffer": 8, "max_tokens": 8}, "overlong_buffer"),
]


@pytest.mark.parametrize(("d", "field"), BAD, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD)])
def test_bad_config_names_the_field(d: dict, field: str) -> None:
    with pytest.raises(ValueError) as e:
        AlgoConfig.from_dict(d)
    assert str(e.value).split(":")[0] == field, str(e.value)


def test_unknown_keys_are_all_named() -> None:
    with pytest.raises(ValueError, match=r"\['bogus', 'zzz'\]"):
        AlgoConfig.from_dict({"name": "grpo", "zzz": 1, "bogus": 2})
    with pytest.raises(ValueError, match="^algo:"):
        AlgoConfig.from_dict([("name", "grpo")])  # type: ignore[arg-type]


def test_constructor_validates_and_points_to_preset() -> None:
    with pytest.raises(ValueError, match="^gate:"):
        AlgoConfig(name="gspo")
    with pytest.raises(ValueError, match=r"^adv_std_norm:.*preset"):
        AlgoConfig(name="rloo")
    AlgoConfig.preset("gspo")
    AlgoConfig.preset("rloo")


@pytest.mark.parametrize("name", ALGORITHM_NAMES)
def test_presets_are_valid_and_round_trip(name: str) -> None:
    cfg = AlgoConfig.preset(name, max_tokens=16)
    assert cfg.name == name
    for k, v in PRESETS[name].items():
        assert getattr(cfg, k) == v
    assert AlgoConfig.from_dict(cfg.to_dict()) == cfg
    assert get_algorithm(cfg, "torch").cfg == cfg


def test_from_dict_applies_the_preset_then_overrides() -> None:
    dapo = AlgoConfig.from_dict({"name": "dapo"})
    assert (dapo.eps_low, dapo.eps_high, dapo.kl_beta) == (0.2, 0.28, 0.0)
    assert AlgoConfig.from_dict({"name": "dapo", "eps_high": 0.3, "kl_beta": 0.01}).eps_high == 0.3
    assert AlgoConfig.from_dict({}) == AlgoConfig()


def test_gate_deltas_default_per_gate() -> None:
    assert AlgoConfig().gate_deltas() == (0.15, 0.15)
    assert AlgoConfig(gate="kl").gate_deltas() == (0.05, 0.05)
    assert AlgoConfig(gate="kl", gate_delta_high=0.1).gate_deltas() == (0.05, 0.1)


def test_unknown_backend_is_named() -> None:
    with pytest.raises(ValueError, match="^backend:"):
        get_algorithm(AlgoConfig(), "jax")


def test_multi_turn_knobs_default_and_round_trip() -> None:
    cfg = AlgoConfig.preset("gigpo")
    assert (cfg.gigpo_omega, cfg.gigpo_gamma, cfg.echo_alpha, cfg.echo_schedule) == (1.0, 0.95, 0.0, "constant")
    assert (cfg.eps_low, cfg.gate, cfg.kl_beta, cfg.adv_std_norm) == (0.2, "tv", 0.001, True)  # GRPO's preset
    knobs = {"name": "dapo", "echo_alpha": 0.1, "echo_schedule": "linear_taper_to_zero"}
    assert AlgoConfig.from_dict(AlgoConfig.from_dict(knobs).to_dict()).echo_schedule == "linear_taper_to_zero"


def test_training_config_takes_the_knobs_from_toml_and_flags(tmp_path, stoa_cache, capsys) -> None:
    from stoa.cli import main
    from stoa.config import ConfigError, LocalConfig, TrainerConfig, load_config

    f = tmp_path / "run.toml"
    f.write_text('algorithm = "gigpo"\nsteps = 10\n[algo]\ngigpo_omega = 0.5\necho_alpha = 0.05\n'
                 'echo_schedule = "linear_taper_to_zero"\n')
    algo = load_config(TrainerConfig, toml_path=f, env={}).algo_config()
    assert (algo.name, algo.gigpo_omega, algo.echo_alpha, algo.echo_schedule) == (
        "gigpo", 0.5, 0.05, "linear_taper_to_zero")
    local = load_config(LocalConfig, overrides={"algo": {"gigpo_gamma": 0.9, "echo_alpha": 1}}, env={})
    assert (local.algo_config().gigpo_gamma, local.algo_config().echo_alpha) == (0.9, 1)
    with pytest.raises(ConfigError, match="^algo.gigpo_gamma:"):
        load_config(TrainerConfig, overrides={"algo": {"gigpo_gamma": 2.0}}, env={})
    with pytest.raises(ConfigError, match="^algo.echo_schedule: 'linear_taper_to_zero' tapers over"):
        load_config(TrainerConfig, overrides={"algo": {"echo_alpha": 0.1, "echo_schedule": "linear_taper_to_zero"}},
                    env={})
    new_run = ["--bucket", str(tmp_path / "b"), "--run", "r", "--model", "tiny"]
    assert main(["trainer", "--dry-run", *new_run, "--algorithm", "gigpo", "--algo", "echo_alpha=0.25",
                 "--algo", "gigpo_gamma=0.9"]) == 0
    out = capsys.readouterr().out
    for line in ("# name = 'gigpo'", "# echo_alpha = 0.25", "# gigpo_gamma = 0.9", "# gigpo_omega = 1.0",
                 "# echo_schedule = 'constant'"):
        assert line in out, line
