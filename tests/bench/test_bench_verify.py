"""`stoa bench verify` end to end on a few records: honest streams judged, an attack's records-to-detect, and the
saved scores judged again under other settings without sampling."""

from __future__ import annotations

import argparse
import json

import pytest

from stoa.bench import verify


def run(flags: list[str]) -> int:
    p = argparse.ArgumentParser()
    verify.add_arguments(p)
    return verify.main(p.parse_args(flags))


@pytest.mark.slow  # about 10 s on a quiet 2-core box (two engines, the tiny model)
def test_honest_torch_is_not_quarantined_a_model_swap_is_at_the_first_possible_record(tiny_dir, tmp_path):
    out, scores = tmp_path / "v.jsonl", tmp_path / "s.npz"
    assert run(["--model", str(tiny_dir), "--engines", "torch:float32", "--planes", "bf16", "--trainers", "fp32",
                "--sequences", "32", "--groups", "4", "--stream", "4", "--attacks", "6", "--attack-records", "16",
                "--attack-streams", "5", "--max-new-tokens", "8", "--out", str(out),
                "--save-scores", str(scores)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    honest, swap = rows
    assert honest["kind"] == "HonestRow" and honest["records"] == 8 and honest["sequences"] == 32
    assert honest["workers"] == 2 and honest["quarantined"] == 0 and honest["score_max"] < 0.065
    assert swap["kind"] == "AttackRow" and swap["detected"] == swap["streams"] == 5
    assert swap["median_records"] == 12  # scores at the cap 0.15: +0.085 a record, limit 1.0
    again = tmp_path / "again.jsonl"
    assert run(["--load-scores", str(scores), "--limit", "0.3", "--stream", "8", "--attack-streams", "5",
                "--out", str(again)]) == 0
    honest2, swap2 = [json.loads(x) for x in again.read_text().splitlines()]
    assert honest2["workers"] == 1 and honest2["score_mean"] == honest["score_mean"]
    assert swap2["median_records"] == 4  # 0.3 / 0.085: over at the fourth
