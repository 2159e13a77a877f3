"""`stoa bench verify --lora-rank`: workers on the contract's base plus the adapter against the trainer's LoRA policy
(the honest residual is small, the adapter moves both sides), and a worker on a lower-precision base is caught."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from stoa.bench import verify
from stoa.bench.verify.lora import LoraRig, lora_lies


def flags(extra: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    verify.add_arguments(p)
    return p.parse_args(extra)


def mean_abs(residuals) -> float:
    return float(np.mean([np.abs(np.concatenate(r)).mean() for r in residuals]))


@pytest.mark.parametrize(("engine", "base_plane", "plane"), [("torch", "int8g64", "int8g64"), ("mlx", "", "bf16")])
def test_lora_workers_agree_with_the_trainer_and_the_adapter_moves_both_sides(tiny_dir, engine, base_plane, plane):
    from stoa.models.lora_torch import lora_disabled

    rig = LoraRig(flags(["--model", str(tiny_dir), "--lora-rank", "4", "--lora-base-plane", base_plane, "--groups",
                         "2", "--n-samples", "2", "--max-new-tokens", "4"]), plane)
    groups, _ = rig.sample(engine, "float32", rig.base, plane, 1, 1.0)
    resid = list(rig.residuals(groups, False))
    assert [[d.shape for d in r] for r in resid] == [[c.shape for c in g.tokens] for g in groups]
    honest = mean_abs(resid)
    assert honest < 2e-3  # fp32 on both sides; the worker's adapter is the published bf16 rounding of the trainer's
    with lora_disabled(rig.policy.model):  # the trainer without its adapter
        assert mean_abs(rig.residuals(groups, False)) > 20 * honest
    rig.adapter_on = False  # a worker without the adapter
    bare, _ = rig.sample(engine, "float32", rig.base, plane, 1, 1.0)
    assert mean_abs(rig.residuals(bare, False)) > 20 * honest


def test_a_worker_on_a_lower_precision_base_than_the_contracts_is_quarantined(tiny_dir, tmp_path):
    assert [x.how.plane for x in lora_lies("int8g64")] == ["int4g64", ""]
    assert lora_lies("int4g64")[0].how.bits == 3 and not lora_lies("bf16")[1].adapter
    out = tmp_path / "v.jsonl"
    assert verify.main(flags(["--model", str(tiny_dir), "--lora-rank", "4", "--lora-base-plane", "int8g64",
                              "--engines", "mlx:float32", "--trainers", "fp32", "--sequences", "16", "--groups",
                              "4", "--stream", "4", "--attacks", "1", "--attack-records", "12", "--attack-streams",
                              "3", "--max-new-tokens", "8", "--lag-records", "0", "--liar-engine", "mlx:float32",
                              "--drift", "0.02", "--no-intake", "--out", str(out)])) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    honest, = [r for r in rows if r["kind"] == "HonestRow"]
    lie, = [r for r in rows if r["kind"] == "AttackRow"]
    assert honest["pair"] == "mlx float32 / int8g64 base + LoRA r4 / fp32" and honest["quarantined"] == 0
    assert lie["attack"] == "int4g64 base (contract: int8g64)"
    assert lie["detected"] == lie["streams"] == 3 and lie["score_mean"] > 10 * honest["score_mean"]


def test_lora_base_plane_needs_a_lora_rank(tiny_dir):
    with pytest.raises(SystemExit, match="--lora-rank"):
        verify.main(flags(["--model", str(tiny_dir), "--lora-base-plane", "int4g64", "--engines", "mlx:float32",
                           "--planes", "bf16", "--trainers", "fp32", "--sequences", "1", "--groups", "1",
                           "--n-samples", "1", "--max-new-tokens", "1", "--lag-records", "0", "--attacks", "none",
                           "--no-intake"]))
