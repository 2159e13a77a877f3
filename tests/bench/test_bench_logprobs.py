"""The logprob-agreement report for the torch engine: fp32 agrees with the recompute, bf16 shows its gap."""

from __future__ import annotations

import json

from stoa.bench.checkout import load_script

run_logprob_report = load_script("logprob_gap.py").run_logprob_report


def test_torch_engine_report_fp32_agrees_and_bf16_is_measured(tiny_dir, tmp_path):
    out = tmp_path / "lp.jsonl"
    lines: list[str] = []
    kw = dict(groups=2, samples=2, tokens=6, engine="torch", out=out, echo=lines.append)
    fp32 = run_logprob_report(str(tiny_dir), "float32", "bf16", **kw)
    bf16 = run_logprob_report(str(tiny_dir), "bfloat16", "bf16", **kw)
    # The heading names the plane (the report's "plane" key holds the plane reference's figures).
    assert lines[0].startswith("torch engine float32 (bf16 plane) vs torch fp32 recompute, ")
    assert [ln.split()[0] for ln in lines[1:4]] == ["reference", "master", "plane"]
    assert fp32["tokens"] > 0 and fp32["plane"]["max_abs"] < 1e-4  # same weights, same dtype: same numbers
    assert 0 < bf16["plane"]["mean_abs"] < 0.05
    assert abs(bf16["plane"]["mean_ratio"] - 1.0) < 0.05
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["engine"], r["dtype"]) for r in rows] == [("torch", "float32"), ("torch", "bfloat16")]
