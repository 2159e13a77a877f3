"""The MLX engine on every family's cache kinds: attention KV, lfm2's conv state, qwen3.5's linear-attention
state, and MoE experts. Recorded logprobs agree with a transformers fp32 full forward; a row in a batch scores
like the same tokens alone (no left padding leaks into a state); hybrid episodes pause and resume exactly; the
int8g64 plane loads into MoE experts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from stoa.engines.mlx.engine import MLXEngine
from stoa.engines.mlx.sampling import sampling_logprobs_mlx
from stoa.episodes.driver import EpisodeDriver
from stoa.rollouts.episode import ROLE_ACTION
from tests.engines.test_mlx_episodes import EOS as EP_EOS
from tests.engines.test_mlx_episodes import LIMITS, FixedTools, TinyEnv, recompute

pytestmark = pytest.mark.mlx

FAMILIES = ("tiny-qwen3", "tiny-qwen3-moe", "tiny-lfm2", "tiny-lfm2-moe", "tiny-qwen3.5", "tiny-qwen3.5-moe")
HYBRIDS = ("tiny-lfm2", "tiny-lfm2-moe", "tiny-qwen3.5", "tiny-qwen3.5-moe")
PROMPTS = [[5, 6, 7, 8, 9, 40, 41], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 300, 301]]
EOS = tuple(range(3, 20))  # ~3% of the ids per step: some rows stop early (dropped), others run to length
TOL = 1e-4  # the gate of tests/engines/test_mlx_engine.py


@pytest.fixture(scope="module")
def family(stoa_cache: Path):
    """name -> (directory, fp32 MLX engine, fp32 transformers model), each built once."""
    import torch
    from transformers import AutoModelForCausalLM

    from stoa.models import resolve_model

    built: dict[str, tuple[Path, MLXEngine, Any]] = {}

    def get(name: str) -> tuple[Path, MLXEngine, Any]:
        if name not in built:
            d = resolve_model(name, cache_dir=stoa_cache)
            model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            built[name] = (d, MLXEngine(d, dtype="float32"), model)
        return built[name]

    return get


def _torch_logprobs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> np.ndarray:
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits.float()[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].numpy()


def _agreement(engine: MLXEngine, model, temperature: float = 1.0, n: int = 4) -> tuple[np.ndarray, list[str]]:
    groups, stats = engine.generate(PROMPTS, n, max_new_tokens=24, temperature=temperature, eos_ids=EOS,
                                    generator=11)
    assert stats.new_tokens == sum(len(c.tokens) for g in groups for c in g)
    d = [np.abs(np.array(c.logprobs) - _torch_logprobs(model, p, c.tokens, temperature))
         for p, g in zip(PROMPTS, groups, strict=True) for c in g]
    return np.concatenate(d), [c.finish_reason for g in groups for c in g]


@pytest.mark.parametrize("name", FAMILIES)
def test_recorded_logprobs_match_a_transformers_full_forward(family, name) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    _, engine, model = family(name)
    kinds = {type(c).__name__ for c in make_prompt_cache(engine.model)}
    assert ("ArraysCache" in kinds) == (name in HYBRIDS)
    d, finish = _agreement(engine, model, temperature=0.8)
    assert "stop" in finish and "length" in finish, finish  # rows were dropped from every cache
    assert float(d.max()) <= TOL, f"{name}: max |MLX - transformers| {d.max():.2e} (mean {d.mean():.2e})"


@pytest.mark.parametrize("name", FAMILIES)
def test_a_row_sampled_in_a_batch_scores_like_its_tokens_alone(family, name) -> None:
    # prompts of 7, 2 and 11 tokens: the merged batch left-pads the attention KV of the shorter ones, and rows
    # are dropped as they stop; each row alone is one batch-1 forward of prompt + completion, no cache.
    _, engine, _ = family(name)
    groups, _ = engine.generate(PROMPTS, 3, max_new_tokens=20, temperature=1.0, eos_ids=EOS, generator=5)
    worst = 0.0
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for c in group:
            logits = engine.model(mx.array([prompt + c.tokens]))[0, len(prompt) - 1 : -1]
            ref = np.array(sampling_logprobs_mlx(logits, 1.0, 1.0))[np.arange(len(c.tokens)), c.tokens]
            worst = max(worst, float(np.abs(np.array(c.logprobs) - ref).max()))
    assert worst <= 2e-5, f"{name}: a batched row differs from the row alone by {worst:.2e}"


@pytest.mark.parametrize("name", ["tiny-lfm2", "tiny-qwen3.5-moe"])
def test_shared_prefix_equals_per_row_prefill(family, name) -> None:
    _, engine, _ = family(name)
    a, _ = engine.generate(PROMPTS, 3, max_new_tokens=12, eos_ids=EOS, generator=4)
    b, _ = engine.generate(PROMPTS, 3, max_new_tokens=12, eos_ids=EOS, generator=4, share_prefix=False)
    for ga, gb in zip(a, b, strict=True):
        for ca, cb in zip(ga, gb, strict=True):
            assert ca.tokens == cb.tokens
            np.testing.assert_allclose(ca.logprobs, cb.logprobs, atol=1e-5)


# ------------------------------------------------------------------------------------------------ episodes
def _episodes(engine: MLXEngine, codec, prompts, n: int, envs: list[TinyEnv], **kw):
    driver = EpisodeDriver(envs, FixedTools(), codec, LIMITS, EP_EOS)
    return engine.generate_episodes(prompts, n, driver, **kw)


@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_episodes_resume_paused_rows_exactly(family, name) -> None:
    # A paused row's conv / recurrent state is the snapshot from before the step that fed its last token
    # (a state cannot drop a token); it is fed again with the observation, like the KV layers.
    from stoa.tokenize import TextCodec

    d, engine, model = family(name)
    codec = TextCodec(d)
    groups, stats = _episodes(engine, codec, PROMPTS, 2, [TinyEnv(r) for r in range(6)], temperature=0.9, generator=3)
    eps = [e for g in groups for e in g]
    assert sum(len(e.calls) for e in eps) >= len(eps) and stats.extra["rounds"] >= 2  # rows did pause and resume
    worst = 0.0
    for r, ep in enumerate(eps):
        roles = np.array(ep.roles)
        gaps, _ = recompute(model, PROMPTS[r // 2], ep, 0.9, 1.0)  # top_p 1: no nucleus edge
        worst = max(worst, float(gaps[roles == ROLE_ACTION].max()))
    assert worst <= TOL, f"{name}: max |MLX - transformers| action logprob {worst:.2e}"
    greedy = {"greedy": True, "temperature": 0.9}
    batched = [e for g in _episodes(engine, codec, PROMPTS, 2, [TinyEnv(r) for r in range(6)], **greedy)[0]
               for e in g]
    for r in (0, 3, 5):  # each row alone at batch 1 gives the same episode
        (alone,), = _episodes(engine, codec, [PROMPTS[r // 2]], 1, [TinyEnv(r)], **greedy)[0]
        assert alone.tokens == batched[r].tokens and alone.roles == batched[r].roles
        np.testing.assert_allclose(alone.logprobs, batched[r].logprobs, atol=2e-5)


# ------------------------------------------------------------------------------------------- weight planes
def _torch_named(model) -> dict[str, np.ndarray]:
    return {k: p.detach().numpy().astype(np.float32) for k, p in model.named_parameters()}


def _set_experts(state: dict[str, np.ndarray], named: dict[str, np.ndarray], quantized: bool) -> None:
    """The fused 3-D expert tensors as int8g64 codes (``<name>``, ``<name>.scales``, ``<name>.biases``, where the
    input dimension allows) or as bf16 bits, whichever the plane's own rule chose."""
    from stoa.weights.planes import f32_to_bf16_bits, quantize_int8g64

    for k, w in named.items():
        if ".experts." not in k or w.ndim != 3:
            continue
        for suffix in (".scales", ".biases"):
            state.pop(k + suffix, None)
        state[k] = f32_to_bf16_bits(w)
        if quantized and w.shape[-1] % 64 == 0:
            state[k], state[f"{k}.scales"], state[f"{k}.biases"] = (
                a.reshape(*w.shape[:-1], -1) for a in quantize_int8g64(w.reshape(-1, w.shape[-1])))


def _dequantized(state: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The weights MLX computes with: (lookup, matmul). Quantized layers multiply by ``code * scale + bias`` in
    float32 (the BLAS path's and ``gather_qmm``'s formula), and so does a float32 engine's embedding lookup on the
    CPU (``BlasQuantizedEmbedding``); ``lookup`` is ``planes.state_to_f32`` (bf16 values) for the other tensors."""
    from stoa.weights.planes import bf16_bits_to_f32, state_to_f32

    fused = {k for k, v in state.items() if v.dtype == np.uint32 and v.ndim == 3}
    lookup = state_to_f32({k: v for k, v in state.items() if k.removesuffix(".scales").removesuffix(".biases")
                           not in fused}, "int8g64")
    matmul = {}
    for k, v in state.items():
        if v.dtype == np.uint32:
            stem = k.removesuffix(".weight")
            codes = v.astype("<u4").view(np.uint8).reshape(*v.shape[:-1], -1, 64).astype(np.float32)
            s = bf16_bits_to_f32(state[f"{stem}.scales"])[..., None]
            b = bf16_bits_to_f32(state[f"{stem}.biases"])[..., None]
            matmul[k] = (codes * s + b).reshape(*v.shape[:-1], -1)
    return lookup, matmul


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-lfm2-moe", "tiny-qwen3.5-moe"])
@pytest.mark.parametrize("experts_quantized", [True, False])
def test_int8g64_plane_loads_into_moe_experts(family, name, experts_quantized) -> None:
    import torch
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear
    from transformers import AutoModelForCausalLM

    from stoa.weights.planes import state_from_f32

    d, _, base = family(name)
    named = _torch_named(base)
    state = dict(state_from_f32(named, "int8g64"))
    _set_experts(state, named, experts_quantized)
    engine = MLXEngine(d, dtype="float32")
    engine.load_state(state, "int8g64")
    switch = {p: m for p, m in engine.model.named_modules() if type(m).__name__.endswith("SwitchLinear")}
    gate_up = [m for p, m in switch.items() if p.endswith(("gate_proj", "up_proj"))]  # 64 inputs: quantizable
    assert gate_up and all(isinstance(m, QuantizedSwitchLinear) == experts_quantized for m in gate_up)
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    lookup, matmul = _dequantized(state)
    embed = "model.embed_tokens.weight"  # looked up as the head multiplies by it (BlasQuantizedEmbedding)
    ref.load_state_dict({k: torch.from_numpy(matmul.get(k, lookup.get(k))) for k in named}, strict=False)
    head = torch.from_numpy(matmul[embed])  # every tiny family ties its head to the quantized embedding
    groups, _ = engine.generate(PROMPTS, 2, max_new_tokens=10, temperature=0.9, generator=1)
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for c in group:
            with torch.no_grad():
                h = ref.model(torch.tensor([prompt + c.tokens])).last_hidden_state[0, len(prompt) - 1 : -1]
            want = torch.log_softmax(h @ head.T / 0.9, -1).gather(-1, torch.tensor(c.tokens)[:, None])[:, 0]
            np.testing.assert_allclose(c.logprobs, want.numpy(), atol=1e-4)


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-lfm2-moe", "tiny-qwen3.5-moe", "tiny-qwen3.5"])
def test_trainer_weights_load_onto_the_checkpoint_layout_exactly(family, name) -> None:
    # transformers' fused experts split onto SwitchLinear, qwen3.5's norms and convs mapped by sanitize:
    # loading the torch model's own parameters reproduces the model loaded from disk bit for bit.
    from mlx.utils import tree_flatten

    d, disk, base = family(name)
    engine = MLXEngine(d, dtype="float32")
    engine.load_weights(_torch_named(base))
    want = dict(tree_flatten(disk.model.parameters()))
    got = dict(tree_flatten(engine.model.parameters()))
    assert want.keys() == got.keys()
    for k, v in want.items():
        assert mx.array_equal(v, got[k]).item(), k


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-qwen3.5"])
def test_bf16_on_the_cpu_samples_every_family(family, name) -> None:
    # MLX's CPU gather_mm takes float32 only: bf16 experts multiply in float32 (quantized.use_float32_gather)
    d, _, model = family(name)
    diff, _ = _agreement(MLXEngine(d, dtype="bfloat16"), model, n=2)
    assert np.isfinite(diff).all() and float(diff.mean()) < 0.05, float(diff.mean())
