"""`stoa bench trl` (benchmarks/trl_compare.py): the ratio line, the children's RESULT parsing, their argv and the
order they run in (the TRL venv is never created here: the children are replaced), and our child run by path."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pytest

from stoa.bench.checkout import load_script
from stoa.models.lora_torch import DEFAULT_TARGETS

trl = load_script("trl_compare.py")

RATIO = re.compile(r"^ratio_step=(\d+\.\d\d) ratio_mem=(\d+\.\d\d)$")


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    trl.add_arguments(p)
    return p.parse_args(list(argv))


def _ours(*step_s: float, rss_kb: int = 2_000_000) -> dict:
    return {"rows": [{"step_s": s, "tokens": 4096.0} for s in step_s], "peak_rss_kb": rss_kb}


def _trl(*steps: tuple[float, float], rss_kb: int = 4_000_000) -> dict:
    return {"rows": [{"step_s": s, "gen_s": g, "train_s": s - g, "tokens": 4096.0, "prompt_tokens": 48.0}
                     for s, g in steps], "peak_rss_kb": rss_kb, "versions": {"trl": "1", "transformers": "2",
                                                                            "torch": "3"}}


def test_ratio_line_divides_trl_without_generation_by_ours_and_our_rss_by_trls():
    line = trl.ratio_line(trl.Side(2.0, 2048.0, 1.5), trl.Side(5.0, 819.2, 6.0, gen_s=9.0, full_step_s=14.0))
    m = RATIO.match(line)
    assert m is not None
    assert (float(m[1]), float(m[2])) == (2.5, 0.25)


def test_summarize_drops_warmup_takes_medians_and_trls_step_without_generation():
    ours = trl.summarize([_ours(99.0, 2.0, 4.0, rss_kb=1_000_000), _ours(99.0, 3.0, rss_kb=3_000_000)], 1, False)
    assert (ours.step_s, ours.tokens_per_s, ours.peak_rss_gb) == (3.0, 4096.0 / 3.0, 2.0)
    theirs = trl.summarize([_trl((99.0, 50.0), (10.0, 6.0)), _trl((99.0, 50.0), (12.0, 6.0))], 1, True)
    assert (theirs.step_s, theirs.gen_s, theirs.full_step_s, theirs.peak_rss_gb) == (5.0, 6.0, 11.0, 4.0)
    assert theirs.tokens_per_s == 4096.0 / 5.0


def test_parse_result_takes_the_last_result_line_among_noise():
    out = 'loading\nRESULT {"a": 1}\n{"loss": 0.1}\nRESULT {"a": 2, "rows": []}\n'
    assert trl.parse_result(out) == {"a": 2, "rows": []}
    with pytest.raises(ValueError, match="no RESULT line"):
        trl.parse_result("Traceback ...\n")


def test_children_argv_and_the_spec_the_driver_reads():
    args = _args("--dtype", "bfloat16", "--threads", "3")
    spec = trl.child_spec(args, Path("/m"))
    assert (spec["prompts"], spec["generations"], spec["tokens"], spec["prompt_tokens"]) == (8, 8, 64, 48)
    assert (spec["beta"], spec["threads"], spec["dtype"], spec["micro_batch"]) == (0.001, 3, "bfloat16", 16)
    assert trl.child_spec(_args("--kl-beta", "0.04"), Path("/m"))["beta"] == 0.04
    argv = trl.trl_argv(Path("/v/bin/python"), spec)
    assert argv[:2] == ["/v/bin/python", str(trl.TRL_DRIVER)] and json.loads(argv[2]) == spec
    assert trl.ours_argv(spec)[:3] == [sys.executable, str(trl.TRL_DRIVER.with_name("trl_compare.py")), "--child"]
    # The driver runs in TRL's venv: it must compile, and read only keys the spec has.
    source = trl.TRL_DRIVER.read_text()
    compile(source, str(trl.TRL_DRIVER), "exec")
    assert set(re.findall(r'spec\["(\w+)"\]', source)) <= set(spec)


def test_main_interleaves_fresh_children_and_prints_the_ratio_line_last(monkeypatch, capsys, tmp_path):
    calls: list[str] = []

    def child(cmd: list[str], env: dict[str, str]) -> dict:
        assert env["OMP_NUM_THREADS"] == "2"
        calls.append("trl" if cmd[1] == str(trl.TRL_DRIVER) else "ours")
        return _ours(99.0, 2.0) if calls[-1] == "ours" else _trl((99.0, 50.0), (14.0, 9.0))

    monkeypatch.setattr(trl, "run_child", child)
    monkeypatch.setattr(trl, "ensure_trl_venv", lambda: tmp_path / "python")
    monkeypatch.setattr(trl, "resolve_model", lambda name: tmp_path)
    assert trl.main(_args("--repeats", "2")) == 0
    assert calls == ["ours", "trl", "ours", "trl"]
    m = RATIO.match(capsys.readouterr().out.splitlines()[-1])
    assert m is not None and (float(m[1]), float(m[2])) == (2.5, 0.5)


def test_venv_dir_changes_with_the_pins(monkeypatch, tmp_path):
    monkeypatch.setenv("STOA_CACHE", str(tmp_path))
    first = trl.trl_venv_dir()
    monkeypatch.setattr(trl, "TRL_REQUIREMENTS", (*trl.TRL_REQUIREMENTS, "extra==1"))
    assert first.parent == tmp_path / "venvs" and first.name.startswith("trl-") and trl.trl_venv_dir() != first


def test_trls_pins_are_the_requirements_file_and_its_torch_is_stoas():
    pins = dict(line.split("==") for line in trl.TRL_REQUIREMENTS)
    assert trl.TRL_PINS.name == "requirements-trl.txt" and set(pins) >= {"torch", "trl", "transformers"}
    constraints = Path(__file__).resolve().parents[2] / "constraints.txt"
    assert f"torch=={pins['torch']}" in constraints.read_text().splitlines()


@pytest.mark.slow
def test_our_child_runs_from_the_script_path_and_prints_its_result(tiny_dir, tmp_path):
    import os
    import subprocess

    spec = trl.child_spec(_args("--groups", "1", "--n-samples", "2", "--prompt-tokens", "4", "--max-new-tokens", "3",
                                "--micro-batch", "2", "--threads", "1"), tiny_dir)
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run(trl.ours_argv(spec), capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = trl.parse_result(proc.stdout)
    assert [row["tokens"] for row in result["rows"]] == [6.0, 6.0]  # warm-up + 1 step of 1 x 2 x 3 tokens
    assert all(row["step_s"] > 0 for row in result["rows"]) and result["threads"] == 1


def test_on_policy_sets_behaviour_logprobs_to_the_policys_own():
    import numpy as np
    import torch

    from stoa.bench.trainer import on_policy, synthetic_entries
    from stoa.models import resolve_model
    from stoa.trainer.policy import Policy

    policy = Policy(resolve_model("tiny"), torch.device("cpu"))
    raw = synthetic_entries(2, 3, 5, 4, policy.vocab_size, 0)
    entries = on_policy(raw, policy, 4)
    assert [e.key for e in entries] == [e.key for e in raw]
    for e in entries:
        rec = e.record
        want = policy.group_logprobs(rec.prompt_tokens, [s.tokens for s in rec.samples], 4).detach().numpy()
        got = np.stack([s.logprobs for s in rec.samples])
        assert got.dtype == np.float32 and np.abs(got - want).max() < 1e-6
        assert not np.allclose(got, -2.0)


def test_the_spec_carries_each_sides_precision_and_the_table_names_them_and_the_cpu():
    spec = trl.child_spec(_args("--dtype", "bfloat16", "--compute-weights", "autocast", "--trl-bf16",
                                "--shared-prefix"), Path("/m"))
    assert (spec["compute_weights"], spec["trl_bf16"], spec["shared_prefix"]) == ("autocast", True, True)
    default = trl.child_spec(_args(), Path("/m"))
    assert (default["compute_weights"], default["trl_bf16"], default["shared_prefix"]) == ("bf16_copy", False, False)
    assert trl.precisions(default) == ("fp32, packed", "fp32")
    assert trl.precisions(spec) == ("bf16 autocast, shared prefix", "bf16=True (autocast)")
    side = trl.Side(2.0, 2048.0, 1.5, 1.0, 3.0)
    text = trl.table(spec, side, side, {"trl": "1", "transformers": "2", "torch": "3"}, (0.1, 0.2))
    assert trl.cpu_name() in text.splitlines()[0]
    assert "| stoa train_step (bf16 autocast, shared prefix) |" in text
    assert "| TRL GRPOTrainer (bf16=True (autocast)) without generation |" in text


@pytest.mark.parametrize(("weights", "copy"), [("bf16_copy", True), ("autocast", False)])
def test_our_child_runs_the_specs_compute_weights_and_mode(tiny_dir, monkeypatch, weights, copy):
    import stoa.trainer.step as step

    seen: list[tuple[bool, bool]] = []
    monkeypatch.setattr(step, "train_step", lambda policy, ref, *a, **kw: seen.append(
        (policy.copy is not None, kw["shared_prefix"])))
    spec = trl.child_spec(_args("--dtype", "bfloat16", "--compute-weights", weights, "--shared-prefix", "--groups",
                                "1", "--n-samples", "2", "--prompt-tokens", "4", "--max-new-tokens", "3",
                                "--micro-batch", "2", "--threads", "1"), tiny_dir)
    trl.run_ours(spec)
    assert seen == [(copy, True)] * 2  # warm-up + 1 timed step


def test_the_spec_carries_the_lora_fields_and_the_full_fine_tune_is_rank_0():
    spec = trl.child_spec(_args("--lora-rank", "8", "--lora-alpha", "16", "--lora-targets", "q_proj, v_proj"),
                          Path("/m"))
    assert (spec["lora_rank"], spec["lora_alpha"], spec["lora_targets"]) == (8, 16.0, ["q_proj", "v_proj"])
    default = trl.child_spec(_args(), Path("/m"))
    assert default["lora_rank"] == 0 and default["lora_alpha"] == 32.0
    assert tuple(default["lora_targets"]) == DEFAULT_TARGETS  # the trainer's (PEFT's) default targets
    with pytest.raises(ValueError, match="--lora-targets"):
        trl.child_spec(_args("--lora-rank", "8", "--lora-targets", ","), Path("/m"))


def test_the_driver_maps_the_spec_to_peft_lora_config_keywords():
    driver = load_script("trl_driver.py")
    spec = trl.child_spec(_args("--lora-rank", "8", "--lora-targets", "q_proj,v_proj"), Path("/m"))
    assert driver.lora_kwargs(spec) == {"r": 8, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"],
                                        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}
    assert driver.lora_kwargs({**spec, "lora_alpha": 2.5})["lora_alpha"] == 2.5
    assert driver.lora_kwargs(trl.child_spec(_args(), Path("/m"))) is None  # full fine-tune: no peft_config


def test_with_lora_each_repeat_runs_ours_trls_and_our_full_fine_tune_and_the_table_says_so(monkeypatch, capsys,
                                                                                           tmp_path):
    specs: list[dict] = []

    def child(cmd: list[str], env: dict[str, str]) -> dict:
        specs.append({**json.loads(cmd[-1]), "side": "trl" if cmd[1] == str(trl.TRL_DRIVER) else "ours"})
        if specs[-1]["side"] == "trl":
            return {**_trl((99.0, 50.0), (14.0, 9.0)), "trained_params": 640}
        return {**_ours(99.0, 2.0, rss_kb=1_000_000 if specs[-1]["lora_rank"] else 4_000_000), "trained_params": 640}

    monkeypatch.setattr(trl, "run_child", child)
    monkeypatch.setattr(trl, "ensure_trl_venv", lambda: tmp_path / "python")
    monkeypatch.setattr(trl, "resolve_model", lambda name: tmp_path)
    assert trl.main(_args("--repeats", "2", "--lora-rank", "8", "--lora-targets", "q_proj,v_proj")) == 0
    assert [(s["side"], s["lora_rank"]) for s in specs] == [("ours", 8), ("trl", 8), ("ours", 0)] * 2
    out = capsys.readouterr().out.splitlines()
    assert "LoRA r=8 alpha=32 targets=q_proj,v_proj on both sides" in next(ln for ln in out if "prompts x" in ln)
    assert "our peak RSS, LoRA / full fine-tune: 0.25" in out
    assert "parameters the optimizer steps: ours 640, TRL 640" in out
    assert RATIO.match(out[-1]) is not None
    specs.clear()
    trl.main(_args("--lora-rank", "8", "--no-full", "--repeats", "1"))
    assert [s["side"] for s in specs] == ["ours", "trl"]


def test_our_lora_child_steps_only_the_adapters_against_its_own_base(tiny_dir, monkeypatch):
    import torch

    import stoa.trainer.step as step
    from stoa.models.lora_torch import is_adapter
    from stoa.trainer.policy import BaseView

    seen: list = []
    real = step.train_step
    monkeypatch.setattr(step, "train_step", lambda policy, ref, opt, *a, **kw: (seen.append((policy, ref, opt)),
                                                                                 real(policy, ref, opt, *a, **kw)))
    spec = trl.child_spec(_args("--lora-rank", "4", "--groups", "1", "--n-samples", "2", "--prompt-tokens", "4",
                                "--max-new-tokens", "3", "--micro-batch", "2", "--threads", "1"), tiny_dir)
    result = trl.run_ours(spec)
    policy, ref, opt = seen[-1]
    assert isinstance(ref, BaseView) and ref.policy is policy  # no second model for the KL's reference
    adapters = {n: p for n, p in policy.model.named_parameters() if is_adapter(n)}
    stepped = [p for g in opt.param_groups for p in g["params"]]
    assert adapters and {id(p) for p in stepped} == {id(p) for p in adapters.values()}
    assert result["trained_params"] == sum(p.numel() for p in adapters.values())
    assert all(not p.requires_grad for n, p in policy.model.named_parameters() if n not in adapters)
    assert any(torch.count_nonzero(p) for n, p in adapters.items() if "lora_B" in n)  # the steps moved B off 0


def test_the_benches_reference_is_the_fleet_trainers_none_a_base_view_or_a_frozen_copy(tiny_dir):
    import torch

    from stoa.bench.trainer import reference
    from stoa.models.lora_torch import LoraSpec
    from stoa.trainer.policy import BaseView, Policy

    cpu = torch.device("cpu")
    lora = Policy(tiny_dir, cpu, lora=LoraSpec(4, 8.0))
    assert reference(lora, tiny_dir, 0.0) is None
    view = reference(lora, tiny_dir, 0.04)
    assert isinstance(view, BaseView) and view.policy is lora
    full = Policy(tiny_dir, cpu)
    ref = reference(full, tiny_dir, 0.04)
    assert isinstance(ref, Policy) and ref.model is not full.model
    assert not any(p.requires_grad for p in ref.model.parameters())
