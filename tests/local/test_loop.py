"""The local loop on the tiny model: the toy reward rises, state saves and resumes exactly, interrupts save."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from stoa.local import saved as ckpt
from stoa.local.loop import run_local
from stoa.telemetry.metrics import read_metrics


def _rewards(out: Path) -> np.ndarray:
    rows = read_metrics(out / "metrics.jsonl")
    return np.array([r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r])


@pytest.mark.parametrize("backend", ["torch", pytest.param("mlx", marks=pytest.mark.mlx)])
def test_toy_reward_rises(backend, make_cfg, tmp_path):
    """GRPO with lr 3e-2 on the vowel reward. Sampling at temperature 0.3: the tiny model's logits are broad
    on purpose, and LoRA, unlike the fleet trainer's full fine-tune, cannot rescale the tied embeddings or
    the final norm, so a cooler temperature is what turns its updates into a visible reward change."""
    if backend == "mlx":
        pytest.importorskip("mlx.core", reason="needs mlx (mlx[cpu] on Linux)")
    out = tmp_path / backend
    cfg = make_cfg(backend=backend, steps=16, n_samples=8, groups_per_step=4, lr=3e-2, kl_beta=0.0,
                   temperature=0.3, eval_n=16, output_dir=str(out))
    summary = run_local(cfg, echo=lambda _s: None)
    r = _rewards(out)
    assert len(r) == 16 and summary["step"] == 16
    assert r[-4:].mean() > r[:4].mean() + 0.1, r
    evals = [row for row in read_metrics(out / "metrics.jsonl") if "eval/accuracy" in row]
    assert [e["step"] for e in evals] == [0, 16]
    assert evals[-1]["eval/reward_mean"] > evals[0]["eval/reward_mean"]
    rows = [row for row in read_metrics(out / "metrics.jsonl") if "train/loss" in row]
    assert all(row["train/ratio_mean"] == 1.0 for row in rows)  # one update per batch: old == current
    assert all(row["rollout/decode_vs_forward_logp_max"] < 1e-3 for row in rows)
    assert (out / "adapters" / "adapters.safetensors").is_file()
    config = json.loads((out / "adapters" / "adapter_config.json").read_text())
    assert config["lora_parameters"]["rank"] == 8 and config["num_layers"] == 2


def test_resume_continues_exactly(make_cfg, tmp_path):
    """4 steps in one go == 2 steps, stop, resume to 4: adapters, optimizer state and metrics rows."""
    common = {"steps": 4, "checkpoint_every": 2, "lr": 2e-2, "kl_beta": 0.01}
    whole = tmp_path / "whole"
    run_local(make_cfg(output_dir=str(whole), **common), echo=lambda _s: None)
    split = tmp_path / "split"
    first = run_local(make_cfg(output_dir=str(split), **{**common, "steps": 2}), echo=lambda _s: None)
    assert first["step"] == 2
    lines: list[str] = []
    second = run_local(make_cfg(output_dir=str(split), **common), echo=lines.append)
    assert second["start_step"] == 2 and second["step"] == 4
    assert any("resumed" in ln and "step 2" in ln for ln in lines)
    a, b = ckpt.find_latest(whole), ckpt.find_latest(split)
    assert a is not None and b is not None and a.step == b.step == 4 and a.optimizer_step == 4
    for k in a.adapters:
        np.testing.assert_array_equal(a.adapters[k], b.adapters[k], err_msg=k)
    for k in a.optimizer:
        np.testing.assert_array_equal(a.optimizer[k], b.optimizer[k], err_msg=k)
    np.testing.assert_array_equal(_rewards(whole), _rewards(split))
    assert sorted(p.name for p in (split / "checkpoints").iterdir()) == ["step-000002", "step-000004"]


def test_resume_refuses_another_shape_and_resume_false(make_cfg, tmp_path):
    from stoa.config import ConfigError

    out = str(tmp_path / "r")
    run_local(make_cfg(output_dir=out, steps=1), echo=lambda _s: None)
    with pytest.raises(ConfigError) as e:
        run_local(make_cfg(output_dir=out, steps=2, lora_rank=4), echo=lambda _s: None)
    assert e.value.field == "lora_rank"
    with pytest.raises(ConfigError) as e:
        run_local(make_cfg(output_dir=out, steps=2, resume=False), echo=lambda _s: None)
    assert e.value.field == "resume"


def test_interrupt_saves_and_a_rerun_finishes(make_cfg, tmp_path):
    out = tmp_path / "int"
    cfg = make_cfg(output_dir=str(out), steps=6, checkpoint_every=0)

    def echo(line: str) -> None:
        if line.startswith("[local] step 2/"):
            os.kill(os.getpid(), signal.SIGINT)  # finishes step 2, saves, returns

    summary = run_local(cfg, echo=echo)
    assert summary["interrupted"] and summary["step"] == 2
    saved = ckpt.find_latest(out)
    assert saved is not None and saved.step == 2
    assert not (out / "adapters").exists()
    with open(out / "metrics.jsonl", "a") as fh:  # a row of a step the crash lost: dropped on resume
        fh.write(json.dumps({"step": 3, "rollout/reward_mean": 9.0}) + "\n")
    summary = run_local(cfg, echo=lambda _s: None)
    assert summary["step"] == 6 and not summary["interrupted"]
    assert len(_rewards(out)) == 6 and 9.0 not in _rewards(out)
    assert set(load_file(str(out / "adapters" / "adapters.safetensors"))) == set(saved.adapters)


def test_cli_train_end_to_end(tiny_dir, tmp_path, capsys):
    import argparse

    from stoa.cli import local as cli

    f = tmp_path / "run.toml"
    f.write_text(f'model = "{tiny_dir}"\ntask = "toy"\nbackend = "torch"\nthreads = 1\nmax_new_tokens = 6\n'
                 f'groups_per_step = 1\neval_n = 4\noutput_dir = "{tmp_path / "cli"}"\n')
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["local", "train", "--config", str(f), "--steps", "2", "--n-samples", "3",
                              "--beta", "0.01", "--available-memory-gb", "8", "--old-logprobs", "reuse"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "preflight: estimated peak memory" in out and "fits" in out
    assert "done: step 2/2" in out and "held-out accuracy" in out
    rows = read_metrics(tmp_path / "cli" / "metrics.jsonl")
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]
    assert all(r["train/ratio_mean"] == 1.0 and r["train/old_logp_s"] < 1e-3 for r in rows if "train/loss" in r)
    assert all(r["rollout/new_tokens"] <= 3 * 6 for r in rows if "train/loss" in r)
    assert "n_samples = 3" in (tmp_path / "cli" / "config.toml").read_text()
