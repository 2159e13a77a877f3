"""Model shapes for the memory preflight: the config.json figures of a model, read without loading (or
downloading) its weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["KNOWN_SHAPES", "ModelShape", "shape_for", "shape_from_dir"]

KNOWN_SHAPES: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-0.6B": {"model_type": "qwen3", "num_hidden_layers": 28, "hidden_size": 1024,
                        "intermediate_size": 3072, "vocab_size": 151936, "num_attention_heads": 16,
                        "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True,
                        "max_position_embeddings": 40960},
    "Qwen/Qwen2.5-0.5B-Instruct": {"model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896,
                                   "intermediate_size": 4864, "vocab_size": 151936, "num_attention_heads": 14,
                                   "num_key_value_heads": 2, "tie_word_embeddings": True,
                                   "max_position_embeddings": 32768},
    "HuggingFaceTB/SmolLM2-135M-Instruct": {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576,
                                            "intermediate_size": 1536, "vocab_size": 49152,
                                            "num_attention_heads": 9, "num_key_value_heads": 3,
                                            "tie_word_embeddings": True, "max_position_embeddings": 8192},
}
"""config.json figures of a few hub models, so a preflight (and --dry-run) works before anything is downloaded."""
KNOWN_SHAPES["smollm2-135m"] = KNOWN_SHAPES["HuggingFaceTB/SmolLM2-135M-Instruct"]
KNOWN_SHAPES["mlx-community/Qwen3-0.6B-4bit"] = KNOWN_SHAPES["Qwen/Qwen3-0.6B"]

@dataclass(frozen=True)
class ModelShape:
    """The config.json figures the estimate needs."""

    name: str
    model_type: str
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    max_positions: int
    hybrid: bool = False

    @classmethod
    def from_config(cls, name: str, c: dict[str, Any]) -> ModelShape:
        """Read a config.json dict (text_config nested configs are unwrapped).

        Args:
            name: the model name, for messages.
            c: the parsed config.json.
        """
        c = {**c.get("text_config", {}), **{k: v for k, v in c.items() if k != "text_config"}}
        try:
            heads = int(c["num_attention_heads"])
            hidden = int(c["hidden_size"])
            types = c.get("layer_types") or []
            return cls(
                name=name, model_type=str(c.get("model_type", "?")), layers=int(c["num_hidden_layers"]),
                hidden=hidden, intermediate=int(c["intermediate_size"]), vocab=int(c["vocab_size"]), heads=heads,
                kv_heads=int(c.get("num_key_value_heads") or heads), head_dim=int(c.get("head_dim") or hidden // heads),
                tied=bool(c.get("tie_word_embeddings", False)),
                max_positions=int(c.get("max_position_embeddings") or 1 << 20),
                hybrid=any("linear" in str(t) for t in types))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{name}: config.json lacks a figure the memory estimate needs ({e})") from None

    def block_linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each dense decoder-block projection."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def params(self) -> int:
        """Total parameters (embeddings, blocks, norms, and the LM head when untied)."""
        block = sum(a * b for a, b in self.block_linears().values()) + 2 * self.hidden
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * block + self.hidden


def shape_for(model: str) -> ModelShape | None:
    """The model's shape without downloading anything: a local dir, a built-in, the HF cache or ``KNOWN_SHAPES``.

    Args:
        model: the ``model`` setting.

    Returns:
        the shape, or None when no config.json is reachable offline (resolve the model, then ``shape_from_dir``).
    """
    from stoa.models import KNOWN_MODELS, default_cache_dir

    local = Path(model).expanduser()
    if (local / "config.json").is_file():
        return shape_from_dir(local, model)
    if model in KNOWN_MODELS:
        from stoa.models.registry import SMOLLM2_DIR, resolve_model

        cached = default_cache_dir() / "models" / SMOLLM2_DIR
        if model == "smollm2-135m" and not (cached / "config.json").is_file():
            return ModelShape.from_config(model, KNOWN_SHAPES[model])
        return shape_from_dir(cached if model == "smollm2-135m" else resolve_model(model), model)
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(model, "config.json")
        if isinstance(hit, str):
            return ModelShape.from_config(model, json.loads(Path(hit).read_text()))
    except (ImportError, ValueError, OSError):
        pass
    if model in KNOWN_SHAPES:
        return ModelShape.from_config(model, KNOWN_SHAPES[model])
    return None


def shape_from_dir(model_dir: Path, name: str = "") -> ModelShape:
    """Read ``model_dir/config.json``.

    Args:
        model_dir: an HF model directory.
        name: display name (default: the directory).
    """
    return ModelShape.from_config(name or str(model_dir), json.loads((Path(model_dir) / "config.json").read_text()))
