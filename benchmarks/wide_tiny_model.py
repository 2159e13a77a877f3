"""A random llama with SmolLM2-135M's widths (hidden 576, 9 heads of 64, 3 KV heads, MLP 1536) but 2 layers and the
tiny model's 512-token tokenizer: 7.4 M parameters, to measure per-layer weight-plane figures at a real width
without a model-sized run (``stoa bench pulse --model DIR --lora-rank R``, docs/weights.md).

    python benchmarks/wide_tiny_model.py /tmp/wide-llama
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.numpy import save_file

from stoa.models import resolve_model
from stoa.models.tiny import tiny_config, tiny_weights

WIDTHS = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
          "intermediate_size": 1536, "num_hidden_layers": 2}
"""SmolLM2-135M's config values that set the shapes of a decoder block, and 2 blocks."""


def build(out: Path, seed: int = 0) -> Path:
    """Write the model (config, float32 safetensors, the tiny tokenizer files) into ``out``.

    Args:
        out: a new or empty directory.
        seed: the weights' seed.
    """
    out.mkdir(parents=True, exist_ok=True)
    tiny = resolve_model("tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / name).write_bytes((tiny / name).read_bytes())
    cfg = {**tiny_config("llama"), **WIDTHS}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(tiny_weights(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1] if len(sys.argv) > 1 else "wide-llama")))
