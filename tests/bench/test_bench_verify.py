"""`stoa bench verify` end to end on a few records: honest streams judged, an attack's records-to-detect, and the
saved scores judged again under other settings without sampling."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import numpy as np
import pytest

from stoa.bench import verify
from stoa.bench.verify import intake
from stoa.bench.verify.liars import quantized
from stoa.bench.verify.stats import AttackRow
from stoa.bench.verify.steps import StepRow, flatten, step_row, unflatten
from stoa.bench.verify.verdict import intake_verdict, logprob_verdict
from stoa.config import TrainerConfig
from stoa.trainer.sequential import CusumParams


def run(flags: list[str]) -> int:
    p = argparse.ArgumentParser()
    verify.add_arguments(p)
    return verify.main(p.parse_args(flags))


@pytest.mark.slow  # about 10 s on a quiet 2-core box (two engines, the tiny model)
def test_honest_torch_is_not_quarantined_a_model_swap_is_at_the_first_possible_record(tiny_dir, tmp_path):
    out, scores = tmp_path / "v.jsonl", tmp_path / "s.npz"
    assert run(["--model", str(tiny_dir), "--engines", "torch:float32", "--planes", "bf16", "--trainers", "fp32",
                "--sequences", "32", "--groups", "4", "--stream", "4", "--attacks", "6", "--attack-records", "16",
                "--attack-streams", "5", "--max-new-tokens", "8", "--out", str(out), "--lag-records", "0",
                "--save-scores", str(scores), "--no-intake"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    honest, swap = [r for r in rows if r["kind"] in ("HonestRow", "AttackRow")]
    step, = [r for r in rows if r["kind"] == "StepRow"]
    assert step["reason"] == "disagreement" and step["quarantined_after"] == 8  # the default per-step threshold
    assert honest["kind"] == "HonestRow" and honest["records"] == 8 and honest["sequences"] == 32
    assert honest["workers"] == 2 and honest["quarantined"] == 0 and honest["score_max"] < 0.065
    assert swap["kind"] == "AttackRow" and swap["detected"] == swap["streams"] == 5
    # two honest workers are too few to calibrate the drift (3 needed): 0.065, so 0.085 a record; limit 0.3
    assert swap["median_records"] == 4
    again = tmp_path / "again.jsonl"
    assert run(["--load-scores", str(scores), "--drift", "0.065", "--limit", "1.0", "--stream", "8",
                "--attack-streams", "5",
                "--out", str(again), "--no-intake"]) == 0
    rows2 = [json.loads(x) for x in again.read_text().splitlines()]
    honest2, swap2 = [r for r in rows2 if r["kind"] in ("HonestRow", "AttackRow")]
    step2, = [r for r in rows2 if r["kind"] == "StepRow"]  # the residuals were saved and judged again
    assert {k: step2[k] for k in StepRow.__dataclass_fields__} == {k: step[k] for k in StepRow.__dataclass_fields__}
    assert honest2["workers"] == 1 and honest2["score_mean"] == honest["score_mean"]
    assert swap2["median_records"] == 12  # judged again at the old defaults: 1.0 / 0.085, over at the twelfth
    with np.load(scores) as z:  # the trainer's rounding probe on the plane's records (stoa.trainer.rounding)
        probe = z["round:bf16"]
    assert probe.shape == (8,) and np.all((probe > 0) & (probe < 0.05))


def verdicts(rows) -> dict[str, tuple[str, str]]:
    return {v.attack: (v.detector, v.detected) for v in map(intake_verdict, rows)}


def test_single_turn_intake_attacks_are_rejected_or_named_as_not_detected(tiny_dir):
    got = verdicts(intake.single_turn(tiny_dir))
    assert got == {
        "control: an honest record": ("-", "accepted"),
        "prompt swap (tokens of another prompt)": ("intake: `prompt`", "yes"),
        "replayed record, the same worker's new key": ("intake: `duplicate`", "yes"),
        "replayed record under another identity": ("intake: `duplicate`", "yes"),
        "replayed record relabelled to a newer version": ("intake: `replayed`", "yes"),
        "copy with one logprob moved 1 ulp": ("none", "no"),
        "rewards claimed higher than the verifier's": ("reward re-scoring", "neutralised"),
        "a lie written under version current - 1 (lag dodge)": ("none", "no"),
    }


def test_multi_turn_forgeries_are_rejected_by_the_replay(tiny_dir):
    got = verdicts(intake.multi_turn(tiny_dir))
    assert got == {
        "control: an honest search episode": ("-", "accepted"),
        "observation other than the tool's (honest digest)": ("intake: `observation`", "yes"),
        "a document appended after the real observation": ("intake: `observation`", "yes"),
        "forged result digest": ("intake: `observation`", "yes"),
        "an observation after a turn that makes no call": ("intake: `turn_end`", "yes"),
        "a document written as the model's own turn": ("intake: `turn_end`", "yes"),
    }


def test_the_per_step_checks_drop_a_gross_liar_at_once_and_quarantine_a_mild_one_by_its_cusum():
    gross = [[np.full(8, 2.0)] * 4 for _ in range(16)]  # exp(2) - 1 = 6.4 a token: over RECOMPUTE_LIMIT 3
    row = step_row("gross", gross, per_step=8, temperature=1.0)
    assert (row.dropped, row.first_dropped, row.reason, row.quarantined_after, row.steps) == (16, 1, "disagreement",
                                                                                              8, 1)
    mild = [[np.full(8, -0.1)] * 4 for _ in range(64)]  # 0.105 a record: under 0.15, over the drift 0.065
    row = step_row("mild", mild, per_step=8, temperature=1.0)
    assert (row.dropped, row.reason, row.quarantined_after, row.steps) == (0, "sequential", 8, 1)  # 8th: 0.321 > 0.3
    assert step_row("lagged", mild, per_step=8, temperature=1.0, cfg=TrainerConfig(quarantine_sequential=False)
                    ).reason == ""


def test_saved_residuals_read_back_and_a_4_bit_base_has_16_levels_a_group():
    records = [[np.arange(3.0), np.arange(5.0)], [np.zeros(0), np.ones(2)]]
    back = unflatten(*flatten(records))
    assert [[x.tolist() for x in r] for r in back] == [[x.tolist() for x in r] for r in records]
    w = np.random.default_rng(0).normal(size=(4, 128)).astype(np.float32)
    norm = w[0]
    q = quantized({"model.layers.0.mlp.up_proj.weight": w, "norm.weight": norm}, bits=4)
    assert all(np.unique(g).size <= 16 for g in q["model.layers.0.mlp.up_proj.weight"].reshape(-1, 64))
    assert np.abs(q["model.layers.0.mlp.up_proj.weight"] - w).max() > 0 and q["norm.weight"] is norm


def test_a_verdict_names_the_check_that_catches_an_attack_first():
    params = CusumParams(drift=0.009, limit=0.3, cap=0.15)
    cusum = AttackRow("noise", 256, 200, 200, 5.0, 6, 0.07)
    slow = StepRow("noise", 256, 0, 0, "sequential", 208, 26)
    assert logprob_verdict(cusum, slow, params).detector.startswith("CUSUM")  # 5 records before 208
    fast = StepRow("noise", 256, 0, 0, "disagreement", 8, 1)
    got = logprob_verdict(replace(cusum, median_records=12.0), fast, params)
    assert got.detector == "quarantine `disagreement` (defaults)"  # 8 records before 12
    gross = StepRow("noise", 256, 256, 1, "disagreement", 8, 1)
    assert logprob_verdict(cusum, gross, params).detector == "recompute check (per sample)"
    missed = logprob_verdict(replace(cusum, detected=0), StepRow("noise", 256, 0, 0, "", 0, 0), params)
    assert (missed.detector, missed.detected) == ("none", "no")


def test_lagged_rows_judge_each_lag_over_the_fleets_level_and_auto_calibrates_the_drift():
    from stoa.bench.verify.lagged import LagScores, fleet_of, load_arrays, save_arrays
    from stoa.trainer.fleet import Level

    rng = np.random.default_rng(0)
    honest = {0: rng.normal(0.0034, 0.0003, 256), 1: rng.normal(0.07, 0.005, 256), 2: rng.normal(0.09, 0.005, 256)}
    lies = {(k, "noise"): rng.normal(0.07 + 0.02 * k, 0.005, 256) + 0.03 for k in (1, 2)}
    ls = LagScores(honest, lies)
    args = argparse.Namespace(drift="auto", limit=0.3, cap=0.15, temperature=1.0, liar_engine="torch:bfloat16",
                              liar_plane="bf16", n_samples=4, stream=32, attack_streams=5, seed=0, drift_factor=2.5)
    params = verify.run_params(args, ls)
    assert params.drift == pytest.approx(2.5 * 0.0034, rel=0.05)  # from the fleet's lag 0
    assert params.limit == pytest.approx(0.3)
    assert verify.run_params(argparse.Namespace(**{**vars(args), "drift": "0.02"}), ls).drift == pytest.approx(0.02)
    h, k = verify.lag_rows(ls, params, args)
    assert [r.pair for r in h] == [f"torch bfloat16 / bf16 / fp32, lag {i}" for i in range(3)]
    assert [r.records for r in h] == [128] * 3 and all(r.quarantined == 0 for r in h)  # the half not fitted on
    assert [r.attack for r in k] == ["noise at lag 1", "noise at lag 2"]
    assert all(r.detected == r.streams == 5 and r.median_records <= 15 for r in k)  # +0.03 over the fleet a record
    split = LagScores({0: np.concatenate([np.full(64, 0.003), np.full(64, 1.0)])}, {})
    assert fleet_of(split).level(0) == Level(0.003, 8)  # fitted on the first half only, 8 workers of 4+ records
    back = load_arrays(save_arrays(ls))
    assert set(back.honest) == {0, 1, 2} and set(back.attacks) == set(lies)
    assert all(np.array_equal(back.attacks[key], lies[key]) for key in lies)


def test_load_scores_names_a_missing_or_foreign_file_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="is not a file"):
        run(["--load-scores", str(tmp_path / "none.npz"), "--no-intake"])
    (tmp_path / "junk.npz").write_bytes(b"not a numpy archive")
    with pytest.raises(SystemExit, match="is not a --save-scores file"):
        run(["--load-scores", str(tmp_path / "junk.npz"), "--no-intake"])


@pytest.mark.parametrize(("flag", "value", "says"), [("--drift-factor", "1.0", "must be in \\(1, 10\\]"),
                                                     ("--drift-factor", "-2", "must be in"),
                                                     ("--minority-records", "-1", "must be >= 0")])
def test_a_bad_drift_factor_or_minority_horizon_is_one_line(tmp_path, flag, value, says):
    with pytest.raises(SystemExit, match=says):
        run(["--load-scores", str(tmp_path / "none.npz"), flag, value, "--no-intake"])


def test_the_attack_table_is_printed_only_with_attack_rows():
    from stoa.bench.verify.stats import HonestRow, table

    honest = [HonestRow("torch:float32 / bf16 / fp32", 8, 64, 2, 0, 0.01, 0.02, 0.03, 0.1)]
    attack = AttackRow("swap", 64, 10, 10, 3.0, 4, 0.2)
    assert len(table(honest, [])) == 3 and not any("| attack |" in line for line in table(honest, []))
    assert sum("| attack |" in line for line in table(honest, [attack])) == 1 and len(table(honest, [attack])) == 7
