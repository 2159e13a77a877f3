"""Randomly initialised Llama models built locally (no download), for benchmarks at a real model's size.

``llama-1b`` is a TinyLlama-like shape (hidden 2048, 22 layers, MLP 5632, 32 heads, 8 KV heads) with SmolLM2's
vocabulary size (49152) and tied embeddings: about 1.09e9 parameters. Its weights are random (``tiny_weights``'s
initialisation, numpy only) and its tokenizer is the tiny model's (512 real tokens; the other ids are valid
inputs but never produced by the tokenizer), which is all a training-step benchmark needs.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from safetensors.numpy import save_file

from stoa.models.registry import _dir_lock, default_cache_dir, resolve_model
from stoa.models.tiny import MARKER_FILE, tiny_config, tiny_weights

RANDOM_LLAMA_VERSION = 1
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def llama_1b_config() -> dict[str, Any]:
    """The ``config.json`` of ``llama-1b``: the tiny llama config at TinyLlama-1.1B's width and depth."""
    cfg = tiny_config("llama")
    cfg.update({"hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 8,
                "head_dim": 64, "intermediate_size": 5632, "vocab_size": 49152, "max_position_embeddings": 2048})
    return cfg


RANDOM_MODELS = {"llama-1b": llama_1b_config}
"""Names ``ensure_random_llama`` builds, and their configs."""


def llama_param_count(config: dict[str, Any]) -> int:
    """Parameters of a Llama ``config`` (tied embeddings counted once), computed without building it.

    Args:
        config: a Llama ``config.json`` as a dict (``head_dim`` optional: hidden / heads).
    """
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // nh
    attn = h * nh * hd * 2 + h * nkv * hd * 2  # q, o; k, v
    if config.get("attention_bias"):
        attn += nh * hd + 2 * nkv * hd + h
    mlp = 3 * h * inter + (2 * inter + h if config.get("mlp_bias") else 0)
    layer = attn + mlp + 2 * h  # two RMSNorms
    head = 0 if config.get("tie_word_embeddings", True) else vocab * h
    return vocab * h + config["num_hidden_layers"] * layer + h + head


def _marker(name: str, seed: int) -> dict[str, Any]:
    return {"source": "random-llama", "name": name, "seed": seed, "builder_version": RANDOM_LLAMA_VERSION}


def _ready(final: Path, name: str, seed: int) -> bool:
    try:
        marker = json.loads((final / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return marker == _marker(name, seed) and (final / "model.safetensors").is_file()


def write_random_llama(out_dir: Path, config: dict[str, Any], tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write ``config``, random float32 weights and the tokenizer files of ``tokenizer_dir`` into ``out_dir``.

    Args:
        out_dir: the model directory (created).
        config: a Llama config (see ``llama_1b_config``).
        tokenizer_dir: a model directory whose tokenizer files are copied (the tiny model's).
        seed: weight seed (numpy PCG64; the same seed gives the same bits).
    """

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for f in _TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / f, out_dir / f)
    save_file(tiny_weights(config, seed), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def ensure_random_llama(name: str, cache_dir: Path | None = None, seed: int = 0) -> Path:
    """The directory of random model ``name`` (a key of ``RANDOM_MODELS``), built on first use.

    Args:
        name: e.g. ``llama-1b``.
        cache_dir: cache root (default ``$STOA_CACHE`` or ``~/.cache/stoa``); the model is ``models/<name>-random``.
        seed: weight seed.

    Raises:
        ValueError: an unknown name.
    """

    if name not in RANDOM_MODELS:
        raise ValueError(f"unknown random model {name!r}; use one of {', '.join(RANDOM_MODELS)}")
    final = (Path(cache_dir).expanduser() if cache_dir else default_cache_dir()) / "models" / f"{name}-random"
    if _ready(final, name, seed):
        return final
    tok = resolve_model("tiny", cache_dir)
    with _dir_lock(final):
        if _ready(final, name, seed):
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            write_random_llama(tmp, RANDOM_MODELS[name](), tok, seed)
            (tmp / MARKER_FILE).write_text(json.dumps(_marker(name, seed)) + "\n", encoding="utf-8")
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_bench_model(name: str) -> Path:
    """A model directory: a ``RANDOM_MODELS`` name is built here, anything else goes to ``resolve_model``.

    Args:
        name: e.g. ``llama-1b``, ``tiny``, ``smollm2-135m`` or a directory.
    """

    return ensure_random_llama(name) if name in RANDOM_MODELS else resolve_model(name)
