"""`stoa bench rollout` on the tiny model: every engine decodes the same work and the JSONL says which dtype."""

from __future__ import annotations

import json

from stoa.bench.rollout import format_table, run_rollout_bench


def test_rollout_bench_writes_one_row_per_engine_with_its_dtype(tiny_dir, tmp_path):
    out = tmp_path / "rollout.jsonl"
    printed: list[str] = []
    run_rollout_bench(str(tiny_dir), batch=4, tokens=6, repeats=1, engines=["torch-fp32", "hf", "hf-bf16"],
                      samples=2, prompt_len=8, threads=1, out=out, isolate=False, echo=printed.append)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["engine"] for r in rows] == ["torch-fp32", "hf", "hf-bf16"]
    assert [r["dtype"] for r in rows] == ["float32", "float32", "bfloat16"]
    for r in rows:
        assert r["new_tokens"] == 4 * 6  # EOS ignored: every row decodes all its tokens
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]
    assert rows[0]["prefill_shared_s"] > 0 and rows[0]["prefill_unshared_s"] > 0
    assert "torch-fp32 / hf:" in format_table(rows)
