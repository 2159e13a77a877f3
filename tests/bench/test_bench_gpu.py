"""``stoa bench gpu``: every item's verdict, rehearsed on this CPU with the tiny model, and on CUDA where there is
one (``pytest -m cuda``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from stoa.bench import gpu
from stoa.bench.gpu_items import check_pulse, fleet_learned


def test_pulse_from_device_tensors_keeps_every_promise_on_this_cpu():
    f = check_pulse("tiny", "cpu")
    assert f.ok and f.cast_mismatches == 0 and f.patch_same and f.applied_exact
    assert f.engine_mismatches == 0 and f.elements > 0 and f.patch_mb > 0


def test_the_fleet_item_reads_learning_and_rejections_from_the_metrics(tmp_path):
    metrics = tmp_path / "trainer.jsonl"
    rewards = [0.2, 0.25, 0.2, 0.3, 0.2, 0.3, 0.4, 0.35, 0.5, 0.45]
    rows = [{"step": i + 1, "train/loss": 0.1, "rollout/reward_mean": r} for i, r in enumerate(rewards)]
    rows.insert(2, {"step": 2, "eval/accuracy": 0.9})  # not a step: ignored
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = fleet_learned(metrics)
    assert (got.steps, round(got.first, 3), round(got.last, 3), got.rejected, got.ok) == (10, 0.23, 0.4, 0, True)
    rows[-1]["rollout/rejected/bad_logprobs"] = 2
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert fleet_learned(metrics).rejected == 2 and not fleet_learned(metrics).ok
    flat = [{"step": i + 1, "train/loss": 0.1, "rollout/reward_mean": 0.3} for i in range(10)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in flat))
    assert not fleet_learned(metrics).ok  # no rise, no pass
    assert fleet_learned(tmp_path / "none.jsonl").steps == 0


def test_an_item_that_raises_is_a_fail_verdict_and_the_next_item_still_runs(monkeypatch, capsys):
    def boom(*_):
        raise gpu.CheckFailed("exit 1: CUDA error: no kernel image is available")

    monkeypatch.setitem(gpu.ITEMS, "trainer", boom)
    monkeypatch.setitem(gpu.ITEMS, "decode", lambda *_: gpu.Verdict("decode", True, "fine"))
    args = gpu.argparse.Namespace(device="cpu", quick=True, items="trainer,decode", item_timeout=5.0, out="")
    assert gpu.main(args) == 1
    out = capsys.readouterr().out
    assert "FAIL trainer   CheckFailed: exit 1: CUDA error" in out and "PASS decode" in out


def test_unknown_items_and_a_missing_gpu_are_one_line_errors(capsys):
    args = gpu.argparse.Namespace(device="cpu", quick=True, items="trainer,warp", item_timeout=5.0, out="")
    assert gpu.main(args) == 2 and "unknown item(s) ['warp']" in capsys.readouterr().err
    if not torch.cuda.is_available():
        args = gpu.argparse.Namespace(device="cuda", quick=False, items="trainer", item_timeout=5.0, out="")
        assert gpu.main(args) == 2 and "--device cpu --quick" in capsys.readouterr().err


def run_check(tmp_path, device: str) -> list[dict]:
    out = tmp_path / "gpu.jsonl"
    done = subprocess.run([sys.executable, "-m", "stoa", "bench", "gpu", "--device", device, "--quick", "--out",
                           str(out)], capture_output=True, text=True, timeout=900)
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return rows


@pytest.mark.slow
def test_the_rehearsal_on_this_cpu_passes_every_item(tmp_path):
    rows = run_check(tmp_path, "cpu")
    assert [r["item"] for r in rows] == ["trainer", "preflight", "decode", "pulse", "fleet"]
    assert all(r["ok"] for r in rows), rows
    by = {r["item"]: r["figures"] for r in rows}
    assert by["trainer"]["tokens_per_s"] > 0 and by["decode"]["torch_tok_s"] > 0
    assert 0.5 <= by["preflight"]["ratio"] <= 2.0
    assert by["fleet"]["last"] > by["fleet"]["first"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU check's own device)")
def test_the_check_passes_every_item_on_cuda(tmp_path):
    rows = run_check(tmp_path, "cuda")
    assert all(r["ok"] for r in rows), rows
