"""``stoa local export`` output loads everywhere: transformers with no missing or unexpected keys, ``mlx_lm.load``
(strict: it refuses any parameter its model lacks), the tensor names of the family's own checkpoint, and greedy
tokens that agree between the two loaders and with the run's own model, per family and backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoa.local.fuse import export_local

PROMPTS = [[1, 5, 9, 13], [2, 7, 11], [3, 30, 40, 50, 60]]
NEW = 6
FAMILIES = ["tiny", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-lfm2", "tiny-lfm2-moe", "tiny-qwen3.5",
            "tiny-qwen3.5-moe"]
FAST = {("tiny", "torch"), ("tiny-lfm2-moe", "mlx")}
"""Run by default: a dense torch run, and an MLX run of the family whose names differ most (renamed dense MLP,
fused experts, an ``expert_bias`` buffer); the rest are slow."""


def _train(stoa_cache: Path, tmp: Path, name: str, backend: str) -> tuple[Path, Any]:
    """Two steps of a tiny local run, saved; and the run's own model with the saved adapters."""
    from stoa.config.local import load_local_config
    from stoa.local.loop import make_backend, run_local
    from stoa.local.saved import find_latest
    from stoa.models import resolve_model

    model_dir = resolve_model(name, cache_dir=stoa_cache)
    cfg = load_local_config(None, {"model": str(model_dir), "task": "toy", "backend": backend, "threads": 1,
                                   "eval_n": 0, "n_samples": 4, "groups_per_step": 2, "max_new_tokens": 8,
                                   "max_prompt_tokens": 64, "output_dir": str(tmp / "run"), "steps": 2,
                                   "lr": 5e-2, "kl_beta": 0.0})
    run_local(cfg, echo=lambda _s: None)
    saved = find_latest(tmp / "run")
    assert saved is not None
    assert any(np.abs(v).max() > 0 for k, v in saved.adapters.items() if k.endswith("lora_b"))  # it trained
    own = make_backend(cfg, model_dir)
    own.load_adapter_arrays(saved.adapters)
    return tmp / "run", own


def _greedy_hf(model: Any, prompt: list[int]) -> list[int]:
    import torch

    seq = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def _greedy_mlx(model: Any, prompt: list[int]) -> list[int]:
    import mlx.core as mx

    seq = list(prompt)
    for _ in range(NEW):
        seq.append(int(mx.argmax(model(mx.array([seq]))[0, -1]).item()))
    return seq[len(prompt):]


def check_loads_everywhere(out: Path, base_dir: Path, own: Any) -> None:
    """The export at ``out`` loads cleanly in both loaders, under the base checkpoint's names, and both decode
    what the run's own model decodes.

    Args:
        out: the export.
        base_dir: the base model's directory.
        own: the run's backend with the saved adapters loaded.
    """
    import mlx_lm
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    names = {k for f in out.glob("*.safetensors") for k in safe_open(str(f), "np").keys()}  # noqa: SIM118
    base = {k for f in base_dir.glob("*.safetensors") for k in safe_open(str(f), "np").keys()}  # noqa: SIM118
    assert names == base
    hf, info = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    mlx_model, _ = mlx_lm.load(str(out))  # strict: raises on a parameter the model does not have
    groups, _ = own.rollout(PROMPTS, 1, max_new_tokens=NEW, temperature=1.0, top_p=1.0, eos_ids=[], seed=0,
                            greedy=True)
    for prompt, group in zip(PROMPTS, groups, strict=True):
        want = list(group[0].tokens)
        assert _greedy_hf(hf.eval(), prompt) == want
        assert _greedy_mlx(mlx_model, prompt) == want


@pytest.mark.parametrize("name,backend", [
    pytest.param(n, b, marks=[] if (n, b) in FAST else [pytest.mark.slow], id=f"{n}-{b}")
    for n in FAMILIES for b in ("torch", "mlx")])
def test_export_loads_in_transformers_and_mlx_lm(stoa_cache, tmp_path, name, backend):
    pytest.importorskip("mlx_lm", reason="needs mlx-lm (mlx[cpu] on Linux)")
    from stoa.models import resolve_model

    run_dir, own = _train(stoa_cache, tmp_path, name, backend)
    result = export_local(run_dir, tmp_path / "hf", echo=lambda _s: None)
    assert result.fused > 0 and result.nbytes == sum(f.stat().st_size for f in result.out.glob("*.safetensors"))
    check_loads_everywhere(result.out, resolve_model(name, cache_dir=stoa_cache), own)


def test_mlx_adapter_names_map_onto_transformers_modules():
    from stoa.local.fuse import torch_adapter_names

    expected = {"model.layers.0.feed_forward.w1.lora_a", "model.layers.0.self_attn.q_proj.lora_a",
                "model.layers.1.linear_attn.in_proj_qkv.lora_b"}
    saved = {"model.layers.0.feed_forward.gate_proj.lora_a": 1, "model.layers.0.self_attn.q_proj.lora_a": 2,
             "language_model.model.layers.1.linear_attn.in_proj_qkv.lora_b": 3, "model.other.lora_a": 4}
    assert torch_adapter_names(saved, expected) == {  # a name that maps to nothing expected stays (and fails)
        "model.layers.0.feed_forward.w1.lora_a": 1, "model.layers.0.self_attn.q_proj.lora_a": 2,
        "model.layers.1.linear_attn.in_proj_qkv.lora_b": 3, "model.other.lora_a": 4}
