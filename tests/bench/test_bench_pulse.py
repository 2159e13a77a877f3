"""`stoa bench pulse` on the tiny model: both planes publish, sync bit-identically and write JSONL rows."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stoa.bench.pulse import add_arguments, main, parse_lrs  # noqa: E402

FINAL = re.compile(r"ratio=(\S+) encode_gbps=(\S+) apply_gbps=(\S+) bit_identical=(true|false)")


def test_parse_lrs() -> None:
    assert parse_lrs(None) == [1e-6, 1e-5]
    assert parse_lrs(["3e-6", "1e-5,2e-5"]) == [3e-6, 1e-5, 2e-5]
    with pytest.raises(ValueError):
        parse_lrs(["0"])


@pytest.mark.parametrize("plane", ["bf16", "int8g64"])
def test_bench_pulse_tiny(plane: str, stoa_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "pulse.jsonl"
    bucket = tmp_path / "bucket"
    args = parser.parse_args([
        "--model", "tiny", "--steps", "2", "--plane", plane, "--lr", "1e-6", "--lr", "1e-5",
        "--n-samples", "2", "--max-new-tokens", "8", "--repeat", "1", "--out", str(out), "--bucket", str(bucket),
    ])
    assert main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    m = FINAL.fullmatch(lines[-1])
    assert m is not None, lines[-1]
    assert float(m.group(1)) > 1
    assert float(m.group(2)) > 0 and float(m.group(3)) > 0
    assert m.group(4) == "true"
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "step"]
    summaries = [r for r in rows if r["kind"] == "summary"]
    assert [(r["lr"], r["step"]) for r in steps] == [(1e-6, 1), (1e-6, 2), (1e-5, 1), (1e-5, 2)]
    assert [s["lr"] for s in summaries] == [1e-6, 1e-5]
    assert all(r["bit_identical"] and r["plane"] == plane for r in rows)
    assert all(0 < r["changed_frac"] < 1 and r["patch_bytes"] > 0 and r["ratio"] > 1 for r in steps)
    # The final line is the first lr's summary; a bigger lr changes more stored values.
    assert float(m.group(1)) == pytest.approx(summaries[0]["ratio"], abs=0.051)
    assert summaries[1]["changed_frac"] > summaries[0]["changed_frac"]
    assert summaries[0]["catchup_behind"] == 2
    # The user-given bucket is kept and holds both runs (patches + full anchors) per lr.
    assert len(list((bucket / "runs").iterdir())) == 4


def test_bench_pulse_lora_compares_the_adapter_plane_with_the_merged_patch(stoa_cache: Path, tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "lora.jsonl"
    args = parser.parse_args(["--model", "tiny", "--steps", "2", "--lora-rank", "2", "--lr", "1e-3", "--n-samples",
                              "2", "--max-new-tokens", "6", "--out", str(out), "--bucket", str(tmp_path / "b")])
    assert main(args) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("LoRA r2 (alpha 4) tiny lr 0.001, 2 steps:") and line.endswith("bit-identical: yes")
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    steps, (summary,) = [r for r in rows if r["kind"] == "lora_step"], [r for r in rows if r["kind"] == "lora_summary"]
    assert [r["step"] for r in steps] == [1, 2] and summary["bit_identical"]
    # The adapter plane's versions hold the adapter only: r x (in + out) per adapted linear, 1,024 per layer at r 1.
    assert all(r["adapter_elements"] == 2 * 2 * 1024 and r["merged_elements"] > 10 * r["adapter_elements"]
               for r in steps)
    assert all(r["adapter_synced_bytes"] == r["adapter_patch_bytes"] > 0 for r in steps)
    assert summary["adapter_anchor_bytes"] < summary["merged_anchor_bytes"] / 4
