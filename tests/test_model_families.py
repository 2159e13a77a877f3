"""The tiny qwen3 / MoE / lfm2 / qwen3.5 families: deterministic bytes, transformers == mlx-lm, names, routing."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoa.models import KNOWN_MODELS, make_tiny_model, resolve_model
from stoa.models.tiny import MARKER_FILE, TINY_BUILDER_VERSION

HAS_MLX = importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx_lm") is not None
requires_mlx = pytest.mark.skipif(not HAS_MLX, reason="mlx / mlx-lm not importable")

#: Built-in name -> architecture (also the model_type in its config.json).
FAMILIES = {
    "tiny-qwen3": "qwen3",
    "tiny-qwen3-moe": "qwen3_moe",
    "tiny-qwen3.5": "qwen3_5",
    "tiny-qwen3.5-moe": "qwen3_5_moe",
    "tiny-lfm2": "lfm2",
    "tiny-lfm2-moe": "lfm2_moe",
}
MOE = ("tiny-qwen3-moe", "tiny-qwen3.5-moe", "tiny-lfm2-moe")

#: sha256 of model.safetensors per architecture at seed 0. A change here changes what every cache holds:
#: bump TINY_BUILDER_VERSION (so old caches rebuild) and update these hashes.
WEIGHT_SHA256 = {
    "qwen3": "4fc268efbe9246e7e9b820d2f3c4c935867ed92ad884aa78b6245feb5d193be3",
    "qwen3_moe": "9e1ae0d85ab590a5c85e37baf20979f0d6632e3ea2febbf5ba0f29a40403b33a",
    "lfm2": "5bdcc5123641da5645aa5b047f257637cfd8772dd4d667d2b0217f29fee5c19c",
    "lfm2_moe": "8936afaf6687d7eee3bb3dfaa0dfc7f756495e8c3c1b18537cc39c39f7d0a6f1",
    "qwen3_5": "1f8b4da4e5a18a4ce4713e474a7dc9d77be0cb16016e5ff584b9a0641819b864",
    "qwen3_5_moe": "429bc60a0c7f5901f3898d99a975143dd88ec2ca254835ceb6f775383dd0d817",
}

#: The mlx-lm cache class per layer each family must get: the mix is what the engines have to handle.
CACHE_KINDS = {
    "qwen3": {"KVCache"},
    "qwen3_moe": {"KVCache"},
    "qwen3_5": {"KVCache", "ArraysCache"},
    "qwen3_5_moe": {"KVCache", "ArraysCache"},
    "lfm2": {"KVCache", "ArraysCache"},
    "lfm2_moe": {"KVCache", "ArraysCache"},
}

CHAT = [{"role": "user", "content": "What is 23 + 45?"}]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stoa-cache")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _prompts(model_dir: Path) -> list[list[int]]:
    """The chat prompt plus two fixed id sequences (short, and 64 tokens spanning a linear-attention chunk)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    chat = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    rng = np.random.default_rng(7)
    return [list(chat), [1, 5, 200, 301, 44, 9, 87, 400], rng.integers(3, 512, 64).tolist()]


def _torch_model(model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    loaded: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    model, info = loaded
    assert not any(info.values()), info  # every tensor on disk used, none left at random init
    return model.eval()


@pytest.mark.parametrize("arch", sorted(set(FAMILIES.values())))
def test_family_builds_the_same_bytes_twice(tmp_path: Path, arch: str) -> None:
    a, b = make_tiny_model(tmp_path / "a", arch=arch), make_tiny_model(tmp_path / "b", arch=arch)
    files = sorted(f.name for f in a.iterdir())
    assert files == sorted(f.name for f in b.iterdir())
    assert {f: _sha(a / f) for f in files} == {f: _sha(b / f) for f in files}
    assert _sha(a / "model.safetensors") == WEIGHT_SHA256[arch], "bump TINY_BUILDER_VERSION and the hash"
    assert _sha(make_tiny_model(tmp_path / "s1", arch=arch, seed=1) / "model.safetensors") != WEIGHT_SHA256[arch]


def test_family_build_needs_neither_torch_nor_mlx(tmp_path: Path) -> None:
    code = (
        "import sys; from stoa.models.tiny import make_tiny_model; "
        f"[make_tiny_model({str(tmp_path)!r} + '/' + a, arch=a) for a in sys.argv[1:]]; "
        "print(sorted(m for m in ('torch', 'mlx', 'transformers') if m in sys.modules))"
    )
    archs = sorted(set(FAMILIES.values()))
    out = subprocess.run([sys.executable, "-c", code, *archs], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", FAMILIES)
def test_resolve_model_builds_each_family_once(cache: Path, name: str) -> None:
    assert name in KNOWN_MODELS
    d = resolve_model(name, cache_dir=cache)
    marker = json.loads((d / MARKER_FILE).read_text())
    assert marker == {"source": "tiny", "arch": FAMILIES[name], "seed": 0, "builder_version": TINY_BUILDER_VERSION}
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == FAMILIES[name]
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(name, cache_dir=cache) == d
    assert (d / "model.safetensors").stat().st_mtime_ns == stamp  # cached, not rebuilt


@pytest.mark.mlx
@requires_mlx
@pytest.mark.parametrize("name", FAMILIES)
def test_family_mlx_matches_torch_fp32(cache: Path, name: str) -> None:
    import mlx.core as mx
    import torch
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model_dir = resolve_model(name, cache_dir=cache)
    torch_model = _torch_model(model_dir)
    mlx_model = load(str(model_dir))[0]
    kinds = {type(c).__name__ for c in make_prompt_cache(mlx_model)}
    assert kinds == CACHE_KINDS[FAMILIES[name]]
    for ids in _prompts(model_dir):
        with torch.no_grad():
            want = torch_model(torch.tensor([ids])).logits[0].numpy()
        got = np.array(mlx_model(mx.array([ids])).astype(mx.float32))[0]
        assert np.abs(want).max() > 1.0  # non-trivial logits
        assert np.abs(want - got).max() < 1e-4, (name, len(ids), float(np.abs(want - got).max()))


@pytest.mark.parametrize("name", MOE)
def test_moe_routes_tokens_to_different_experts(cache: Path, name: str) -> None:
    import torch

    model = _torch_model(resolve_model(name, cache_dir=cache))
    chosen: dict[str, list[tuple[int, ...]]] = {}

    def record(layer: str):
        def hook(_mod, _inp, out) -> None:  # routers return (logits, weights, expert ids)
            chosen[layer] = [tuple(sorted(row)) for row in out[2].tolist()]

        return hook

    for layer, module in model.named_modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(record(layer))
    ids = np.random.default_rng(3).integers(3, 512, 48).tolist()
    with torch.no_grad():
        model(torch.tensor([ids]))
    n_experts = model.config.num_experts
    assert chosen, "no router ran"
    for layer, sets in chosen.items():
        assert len(sets) == len(ids)
        assert len(set(sets)) > 1, f"{layer} sends every token to {sets[0]}"
        assert {e for s in sets for e in s} == set(range(n_experts)), f"{layer} leaves experts unused"
