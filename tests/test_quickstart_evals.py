"""The search quickstart's held-out evals during the run: a curve of ``SEARCH_EVALS`` points after the one
before training, however many steps, the last at the final step; ``--set eval_every=N`` still wins."""

from __future__ import annotations

import argparse

import pytest

from stoa.cli.quickstart import SEARCH_EVALS, search_eval_every, trainer_settings


def evals_after_start(steps: int, every: int) -> list[int]:
    """The steps the trainer evaluates at after v1: every ``every`` steps, plus the final step (the trainer's
    'after' eval when the last step is not on the cadence)."""
    at = list(range(every, steps + 1, every))
    return at if at and at[-1] == steps else [*at, steps]


@pytest.mark.parametrize("steps", [1, 2, 3, 5, 8, 12, 13, 20, 30, 31, 100])
def test_a_search_run_evaluates_a_few_times_during_the_run_and_at_its_end(steps):
    at = evals_after_start(steps, search_eval_every(steps))
    assert len(at) <= SEARCH_EVALS and at[-1] == steps
    assert len(at) == min(steps, SEARCH_EVALS)  # with before and cold start: a curve of four points


def _args(**kw) -> argparse.Namespace:
    base = dict(model="smollm2-135m", task="search", steps=12, bucket="b", algorithm="grpo", set=[])
    return argparse.Namespace(**{**base, **kw})


def test_the_smollm2_search_preset_spreads_its_evals_over_the_steps():
    assert trainer_settings(_args(), "r")["eval_every"] == 6  # 12 steps: v1, then steps 6 and 12
    assert trainer_settings(_args(steps=40), "r")["eval_every"] == 20
    assert trainer_settings(_args(steps=8), "r")["cold_start"] == "demos"
    s = trainer_settings(_args(), "r")
    assert s["task"].startswith("search:") and s["eval_n"] == 48 and s.get("eval_k", 1) == 1


def test_set_wins_and_other_presets_keep_their_cadence():
    assert trainer_settings(_args(set=["eval_every=1"]), "r")["eval_every"] == 1
    assert trainer_settings(_args(set=["eval-every=0"]), "r")["eval_every"] == 0
    assert trainer_settings(_args(model="tiny"), "r")["eval_every"] == 1  # CI's tiny search run: every step
    assert trainer_settings(_args(task="arithmetic", steps=30), "r")["eval_every"] == 10


def test_the_summary_sets_the_cold_start_beside_before_and_final_with_pass_at_k():
    from stoa.cli.quickstart import eval_lines

    ev = [{"label": "before", "accuracy": 0.0, "cover_em": 0.0, "em": 0.0, "search_rate": 0.25},
          {"label": "cold start", "accuracy": 0.5, "cover_em": 0.625, "em": 0.5, "search_rate": 1.0, "pass@8": 0.75,
           "sampled_accuracy": 0.375},
          {"label": "step 3", "accuracy": 0.125, "cover_em": 0.125, "em": 0.125, "search_rate": 0.5},
          {"label": "after", "accuracy": 0.75, "cover_em": 0.875, "em": 0.75, "search_rate": 1.0, "pass@8": 1.0,
           "sampled_accuracy": 0.5}]
    for e, two in zip(ev, (0.0, 0.25, 0.0, 0.75), strict=True):
        e["cover_em_2hop"] = two
    rows = {line.split()[0]: line for line in eval_lines(ev)}
    assert "cold start 0.625" in rows["cover-EM"] and "final 0.875" in rows["cover-EM"]
    assert "0.125" not in rows["cover-EM"]  # a mid-run point is not a stage
    assert rows["pass@8"].split("->")[1].strip() == "final 1.000"
    assert "cold start 0.375" in rows["sampled"]
    assert rows["2hop"].split("->")[1:] == [" cold start 0.250 ", " final 0.750"]
    plain = eval_lines([{"label": "before", "accuracy": 0.1}, {"label": "after", "accuracy": 0.6}])
    assert len(plain) == 1 and "after 0.600" in plain[0]


def test_set_takes_algo_knobs_as_the_trainer_does():
    from stoa.config import TrainerConfig, load_config

    s = trainer_settings(_args(set=["algo.echo_alpha=0.05", "algo.echo-schedule=linear_taper_to_zero"]), "r")
    cfg = load_config(TrainerConfig, overrides=s, env={})
    assert cfg.algo == {"echo_alpha": 0.05, "echo_schedule": "linear_taper_to_zero"}


def test_lora_rank_reaches_the_trainer_and_set_still_wins():
    assert "lora_rank" not in trainer_settings(_args(), "r")
    assert trainer_settings(_args(lora_rank=16), "r")["lora_rank"] == 16
    assert trainer_settings(_args(lora_rank=16, set=["lora_rank=8"]), "r")["lora_rank"] == 8


def test_lora_rank_takes_the_measured_lora_lr_unless_set():
    from stoa.cli.quickstart import LORA_LR, PRESETS

    assert trainer_settings(_args(task="arithmetic"), "r")["lr"] == PRESETS["smollm2-135m"]["lr"]
    assert trainer_settings(_args(task="arithmetic", lora_rank=16), "r")["lr"] == LORA_LR
    assert trainer_settings(_args(lora_rank=16, set=["lr=3e-5"]), "r")["lr"] == 3e-5
