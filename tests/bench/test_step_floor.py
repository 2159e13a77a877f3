"""benchmarks/step_floor.py: the matrix products it counts, and a run on the tiny model."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from stoa.bench.checkout import load_script

step_floor = load_script("step_floor.py")


def test_products_per_token_are_counted_from_the_config():
    smollm2 = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                              num_key_value_heads=3, head_dim=64, vocab_size=49152)
    per_layer = 576 * 576 * 2 + 576 * 192 * 2 + 576 * 1536 * 3  # q, o; k, v; gate, up, down
    assert step_floor.macs_per_token(smollm2) == (30 * per_layer, 576 * 49152)


def test_a_tiny_run_prints_both_floors_and_the_ratio(tiny_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["step_floor.py", "--model", str(tiny_dir), "--repeats", "1", "--prompts", "2",
                                      "--generations", "2", "--prompt-tokens", "4", "--tokens", "4",
                                      "--threads", "1", "--ours-s", "1.0", "--trl-s", "2.0"])
    step_floor.main()
    out = capsys.readouterr().out
    assert "decoder forward + backward, eager" in out and "| ours (prompt once per group) |" in out
    from transformers import AutoConfig

    body, head = step_floor.macs_per_token(AutoConfig.from_pretrained(tiny_dir))
    # ours: 2 prompts x (4 + 2 x 3) tokens through the decoder; TRL: 4 rows x 8 tokens; both score 2 x 2 x 4
    want = (body * 32 + head * 16) / (body * 20 + head * 16)
    line = next(x for x in out.splitlines() if x.startswith("step ratio if both sides ran at one rate"))
    assert line.endswith(f": {want:.2f}")


def test_an_unknown_model_is_one_line(monkeypatch):
    import pytest

    monkeypatch.setattr(sys, "argv", ["step_floor.py", "--model", "no-such-model"])
    with pytest.raises(SystemExit, match="unknown model 'no-such-model'; use a built-in name"):
        step_floor.main()
