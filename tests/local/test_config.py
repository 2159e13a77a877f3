"""LocalConfig validation, CLI flags and --dry-run, and the memory preflight (all before any model loads)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from stoa.cli import local as cli
from stoa.cli import main
from stoa.config import ConfigError, DeprecatedSetting, LocalConfig, load_local_config, overrides_from_args
from stoa.config.local import resolve_backend
from stoa.config.memory import MemoryPreflightError
from stoa.local.preflight import estimate_memory, fit, preflight
from stoa.models.shapes import KNOWN_SHAPES, ModelShape


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="stoa")
    sub = parser.add_subparsers(dest="command")
    cli.register(sub)
    return parser.parse_args(argv)


@pytest.mark.parametrize(("overrides", "field"), [
    ({"n_samples": 1}, "n_samples"),
    ({"quant_bits": 3}, "quant_bits"),
    ({"quant_group_size": 48}, "quant_group_size"),
    ({"backend": "jax"}, "backend"),
    ({"lora_rank": 0}, "lora_rank"),
    ({"lora_alpha": 0}, "lora_alpha"),
    ({"lora_targets": "q_proj,bad name"}, "lora_targets"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"groups_per_step": 0}, "groups_per_step"),
    ({"checkpoint_every": -1}, "checkpoint_every"),
    ({"lr": 2.0}, "lr"),
    ({"grad_clip": -1}, "grad_clip"),
    ({"top_p": 0}, "top_p"),
    ({"kl_beta": -0.1}, "kl_beta"),
    ({"algorithm": "ppo"}, "algorithm"),
    ({"algo": {"eps_low": 3}}, "algo.eps_low"),
    ({"algo": {"temperature": 0.5}}, "algo.temperature"),
    ({"algo": {"kl_beta": 0.1}, "kl_beta": 0.2}, "kl_beta"),
    ({"task": "nope"}, "task"),
    ({"dtype": "float8"}, "dtype"),
    ({"device": "tpu"}, "device"),
    ({"torch_base": "gguf"}, "torch_base"),
    ({"eval_n": -1}, "eval_n"),
    ({"steps": "many"}, "steps"),
])
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        load_local_config(None, overrides)
    assert e.value.field == field, str(e.value)
    assert str(e.value).startswith(f"{field}:")


def test_toml_file_then_flags(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('model = "tiny"\nn_samples = 6\nlora_targets = ["q_proj", "v_proj"]\n'
                 '[algo]\neps_high = 0.28\n')
    cfg = load_local_config(str(f), {"n_samples": "3", "seed": "7"})
    assert (cfg.n_samples, cfg.seed, cfg.lora_targets) == (3, 7, "q_proj,v_proj")
    assert cfg.algo_config().eps_high == 0.28
    f.write_text("n_sample = 4\n")
    with pytest.raises(ConfigError, match="n_sample: unknown setting in .*; did you mean 'n_samples'"):
        load_local_config(str(f))


OLD_AND_NEW = [("group_size", "n_samples", 3), ("prompts_per_step", "groups_per_step", 3),
               ("max_tokens", "max_new_tokens", 12), ("save_every", "checkpoint_every", 4)]


@pytest.mark.parametrize(("old", "new", "value"), OLD_AND_NEW)
def test_old_names_warn_and_map(tmp_path, old, new, value):
    f = tmp_path / "old.toml"
    f.write_text(f"{old} = {value}\n")
    with pytest.warns(DeprecatedSetting, match=f"^{old} in .*old.toml is deprecated: rename it {new} "):
        from_file = load_local_config(str(f))
    flag = "--" + old.replace("_", "-")
    with pytest.warns(DeprecatedSetting, match=f"^{flag} is deprecated: use --{new.replace('_', '-')} "):
        from_flag = load_local_config(None, overrides_from_args(_parse(["local", "train", flag, str(value)]),
                                                                LocalConfig))
    assert getattr(from_file, new) == getattr(from_flag, new) == value
    assert getattr(from_file, old) == value  # the old attribute reads the new field
    assert getattr(dataclasses.replace(from_file, **{old: value + 1}), new) == value + 1


@pytest.mark.parametrize(("old", "new", "value"), OLD_AND_NEW)
def test_old_and_new_name_together_is_an_error(tmp_path, old, new, value):
    f = tmp_path / "both.toml"
    f.write_text(f"{old} = {value}\n{new} = {value}\n")
    with pytest.warns(DeprecatedSetting), pytest.raises(ConfigError) as e:
        load_local_config(str(f))
    assert e.value.field == new
    assert f"as {old} in {f} and as {new} in {f}; keep {new}" in str(e.value)
    with pytest.warns(DeprecatedSetting), pytest.raises(ConfigError, match=f"--{old.replace('_', '-')}"):
        load_local_config(None, {new: value, old: value})


def test_a_later_layer_overrides_an_old_name(tmp_path):
    f = tmp_path / "old.toml"
    f.write_text("group_size = 6\n")
    with pytest.warns(DeprecatedSetting):
        assert load_local_config(str(f), {"n_samples": 3}).n_samples == 3


def test_kl_beta_given_twice_names_both_places(tmp_path, capsys):
    f = tmp_path / "run.toml"
    f.write_text("[algo]\nkl_beta = 0.2\n")
    assert main(["local", "train", "--config", str(f), "--kl-beta", "0.1", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"kl_beta: given twice, as --kl-beta and as [algo] kl_beta in {f}; keep one" in err
    f.write_text("kl_beta = 0.1\n[algo]\nkl_beta = 0.2\n")
    with pytest.raises(ConfigError, match=f"as kl_beta in {f} and as \\[algo\\] kl_beta in {f}"):
        load_local_config(str(f))
    f.write_text("[algo]\nmax_tokens = 8\n")
    with pytest.raises(ConfigError, match=r"^algo.max_tokens: \[algo\] max_tokens in .* 'max_new_tokens'"):
        load_local_config(str(f))


def test_local_section_of_a_shared_file(tmp_path):
    f = tmp_path / "shared.toml"
    f.write_text('seed = 5\nbucket = "s3://b/p"\n[trainer]\nlr = 1e-6\n[local]\nn_samples = 4\nlr = 1e-3\n'
                 '[local.algo]\neps_high = 0.3\n')
    cfg = load_local_config(str(f))
    assert (cfg.seed, cfg.n_samples, cfg.lr, cfg.algo) == (5, 4, 1e-3, {"eps_high": 0.3})


def test_algorithm_defaults_and_beta():
    assert load_local_config(None, {"algorithm": "dapo"}).algo_config().kl_beta == 0.0
    algo = load_local_config(None, {"kl_beta": 0.0, "max_new_tokens": 32, "temperature": 0.7}).algo_config()
    assert (algo.kl_beta, algo.max_tokens, algo.temperature) == (0.0, 32, 0.7)


def test_auto_backend():
    assert resolve_backend("torch") == "torch" and resolve_backend("mlx") == "mlx"
    assert resolve_backend("auto") in ("torch", "mlx")


def test_cli_overrides_and_dry_run(capsys):
    args = _parse(["local", "train", "--model", "tiny", "--steps", "5", "--n-samples", "3",
                   "--max-new-tokens", "16", "--algorithm", "dr_grpo", "--beta", "0", "--seed", "9",
                   "--backend", "torch", "--dry-run", "--available-memory-gb", "64"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    for line in ("steps = 5", "n_samples = 3", "max_new_tokens = 16", 'algorithm = "dr_grpo"',
                 "kl_beta = 0.0", "seed = 9", "# backend: torch", "# resolved algorithm",
                 "# name = 'dr_grpo'", "# kl_beta = 0.0", "# adv_std_norm = False",
                 "available 64.00 GB (available_memory_gb): fits"):
        assert line in out, line


def test_cli_smoke_has_model_flags():
    args = _parse(["local", "smoke", "--model", "tiny", "--quant-bits", "8", "--lora-rank", "4"])
    assert (args.model, args.quant_bits, args.lora_rank) == ("tiny", "8", "4")
    with pytest.raises(SystemExit):
        _parse(["local", "smoke", "--steps", "3"])


# ----- memory preflight ------------------------------------------------------------------------------

QWEN = ModelShape.from_config("Qwen/Qwen3-0.6B", KNOWN_SHAPES["Qwen/Qwen3-0.6B"])


def _cfg(**kw) -> LocalConfig:
    return load_local_config(None, {"backend": "mlx", "model": "Qwen/Qwen3-0.6B", "n_samples": 8,
                                    "groups_per_step": 2, "max_new_tokens": 512, "max_prompt_tokens": 256,
                                    **kw})


def test_shape_and_estimate_move_the_right_way():
    assert 590e6 < QWEN.params() < 600e6  # Qwen3-0.6B has 596M parameters (tied embeddings)
    base = estimate_memory(_cfg(), QWEN)
    assert estimate_memory(_cfg(gradient_checkpointing=True), QWEN).total_gb < base.total_gb
    assert estimate_memory(_cfg(n_samples=4), QWEN).total_gb < base.total_gb
    assert estimate_memory(_cfg(max_new_tokens=128), QWEN).total_gb < base.total_gb
    assert estimate_memory(_cfg(quant_bits=16), QWEN).parts["weights"] > 2 * base.parts["weights"]
    assert estimate_memory(_cfg(micro_batch=2), QWEN).total_gb < base.total_gb


def test_refusal_suggests_checkpointing_first():
    cfg = _cfg()
    need = estimate_memory(cfg, QWEN).total_gb
    with_ckpt = estimate_memory(dataclasses.replace(cfg, gradient_checkpointing=True), QWEN).total_gb
    report = fit(cfg, QWEN, available_gb=(need + with_ckpt) / 2, source="test")
    assert not report.fits and report.knob == "gradient_checkpointing"
    assert "gradient_checkpointing = true" in report.message()


def test_refusal_then_micro_batch_then_group_size_then_length():
    ckpt = _cfg(gradient_checkpointing=True)
    one_row = estimate_memory(dataclasses.replace(ckpt, micro_batch=1), QWEN).total_gb
    report = fit(ckpt, QWEN, available_gb=one_row + 0.01, source="test")
    assert report.knob == "micro_batch"
    small = _cfg(gradient_checkpointing=True, micro_batch=1)
    g2 = estimate_memory(dataclasses.replace(small, n_samples=2), QWEN).total_gb
    report = fit(small, QWEN, available_gb=g2 + 0.01, source="test")
    assert report.knob == "n_samples" and report.suggested is not None and report.suggested.n_samples >= 2
    tiny_budget = estimate_memory(dataclasses.replace(small, n_samples=2, max_new_tokens=16), QWEN).total_gb
    report = fit(dataclasses.replace(small, n_samples=2), QWEN, available_gb=tiny_budget + 0.001,
                       source="t")
    assert report.knob == "max_new_tokens"


def test_nothing_fits_names_the_model():
    report = fit(_cfg(quant_bits=16), QWEN, available_gb=0.5, source="test")
    assert report.knob == "model" and "the model alone needs" in report.message()


def test_preflight_raises_with_the_knob_and_checks_positions():
    with pytest.raises(MemoryPreflightError) as e:
        preflight(_cfg(available_memory_gb=1.2), QWEN)
    assert e.value.field in ("gradient_checkpointing", "micro_batch", "n_samples", "max_new_tokens", "model")
    assert "does not fit" in str(e.value)
    with pytest.raises(ConfigError, match="max_new_tokens: .* exceeds the model's 40960 positions"):
        preflight(_cfg(max_new_tokens=40900, available_memory_gb=1000), QWEN)
    assert preflight(_cfg(available_memory_gb=1.2, preflight=False), QWEN).fits is False


def test_train_refuses_before_any_model_loads(make_cfg, monkeypatch, capsys):
    from stoa.local import loop

    def no_load(*_a, **_k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loop, "make_backend", no_load)
    cfg = make_cfg(available_memory_gb=0.3)
    with pytest.raises(MemoryPreflightError) as e:
        loop.run_local(cfg, echo=lambda _s: None)
    assert e.value.field == "model"  # the runtime alone exceeds 0.3 GB
    from stoa.models.shapes import shape_for

    cfg = dataclasses.replace(make_cfg(), max_new_tokens=400, n_samples=16, groups_per_step=4).validate()
    shape = shape_for(cfg.model)
    assert shape is not None and shape.layers == 2
    fits_with_ckpt = estimate_memory(dataclasses.replace(cfg, gradient_checkpointing=True), shape).total_gb
    assert estimate_memory(cfg, shape).total_gb > fits_with_ckpt + 0.01
    with pytest.raises(MemoryPreflightError) as e:
        loop.run_local(dataclasses.replace(cfg, available_memory_gb=fits_with_ckpt + 0.001),
                       echo=lambda _s: None)
    assert e.value.field == "gradient_checkpointing", str(e.value)


def test_dry_run_estimates_a_multi_turn_row_at_its_episode_budget(capsys):
    def peak(task: str) -> float:
        args = _parse(["local", "train", "--model", "tiny", "--task", task, "--backend", "torch", "--dry-run",
                       "--available-memory-gb", "64"])
        assert args.func(args) == 0
        out = capsys.readouterr().out
        return float(out.split("estimated peak memory ")[1].split(" GB")[0])

    short, long = peak("walk:max_total_tokens=256"), peak("walk:max_total_tokens=1024")
    assert peak("arithmetic") < short < long  # prompt + max_total_tokens, not max_new_tokens
