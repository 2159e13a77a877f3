"""Weight planes go straight from the bucket's stored bits into MLX arrays, exactly, or not at all."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from stoa.engines.mlx.engine import MLXEngine
from stoa.weights.planes import state_from_f32, state_to_f32

pytestmark = pytest.mark.mlx

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


def _params(engine: MLXEngine) -> dict[str, np.ndarray]:
    out = {}
    params: list[tuple[str, mx.array]] = tree_flatten(engine.model.parameters())  # type: ignore[assignment]
    for k, v in params:
        out[k] = np.array(v.view(mx.uint16)) if v.dtype == mx.bfloat16 else np.array(v)
    return out


def _perturbed(weights: dict[str, np.ndarray], seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (v + rng.standard_normal(v.shape).astype(np.float32) * 0.01) for k, v in weights.items()}


def test_bf16_plane_in_fp32_engine_is_exact_widening(tiny_dir, tiny_weights) -> None:
    state = state_from_f32(_perturbed(tiny_weights), "bf16")
    eng = MLXEngine(tiny_dir, dtype="float32")
    eng.load_state(state, "bf16")
    widened = state_to_f32(state, "bf16")
    got = _params(eng)
    assert set(got) == set(widened)
    for k, v in widened.items():
        assert got[k].dtype == np.float32 and np.array_equal(got[k], v), k


def test_bf16_plane_in_bf16_engine_keeps_the_bits(tiny_dir, tiny_weights) -> None:
    state = state_from_f32(tiny_weights, "bf16")
    eng = MLXEngine(tiny_dir, dtype="bfloat16")
    eng.load_state(state, "bf16")
    got = _params(eng)
    for k, bits in state.items():
        assert np.array_equal(got[k], bits), k
    groups, _ = eng.generate(PROMPTS, 2, max_new_tokens=4, generator=0)
    assert all(np.isfinite(c.logprobs).all() for g in groups for c in g)


def test_bf16_plane_logprobs_match_torch_on_the_same_bits(tiny_dir, tiny_weights) -> None:
    torch = pytest.importorskip("torch", reason="the comparison needs torch")
    from stoa.engines.torch import TorchEngine

    state = state_from_f32(_perturbed(tiny_weights, 2), "bf16")
    eng = MLXEngine(tiny_dir, dtype="float32")
    eng.load_state(state, "bf16")
    te = TorchEngine(tiny_dir, device="cpu")
    te.load_weights(state_to_f32(state, "bf16"))
    groups, _ = eng.generate(PROMPTS, 3, max_new_tokens=12, temperature=1.2, generator=4)
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for c in group:
            with torch.no_grad():
                logits = te.model(torch.tensor([prompt + c.tokens])).logits[0, len(prompt) - 1 : -1]
            ref = torch.log_softmax(logits / 1.2, -1).gather(-1, torch.tensor(c.tokens)[:, None])[:, 0]
            np.testing.assert_allclose(c.logprobs, ref.numpy(), atol=1e-4)


def test_int8g64_plane_equals_mlx_quantize(tiny_dir, tiny_weights) -> None:
    state = state_from_f32(tiny_weights, "int8g64")
    eng = MLXEngine(tiny_dir, dtype="float32")
    eng.load_state(state, "int8g64")
    # Reference: mlx-lm's own path (bf16 weights, nn.quantize with group 64, 8 bits).
    ref = MLXEngine(tiny_dir, dtype="bfloat16")
    nn.quantize(ref.model, group_size=64, bits=8)
    got, want = _params(eng), _params(ref)
    assert set(got) == set(want)
    for k, v in want.items():
        g = got[k]
        if g.dtype == np.float32 and v.dtype == np.uint16:  # fp32 engine: unquantized tensors widened
            g = np.array(mx.array(g).astype(mx.bfloat16).view(mx.uint16))
        assert np.array_equal(g, v), k
    assert isinstance(eng.model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert isinstance(eng.model.model.embed_tokens, nn.QuantizedEmbedding)


def test_int8g64_logprobs_match_torch_on_mlx_dequantized_weights(tiny_dir, tiny_weights) -> None:
    # What MLX computes with int8g64 layers: quantized matmuls (every Linear and the tied head) dequantize
    # in float32 (code * scale + bias, no bf16 rounding), and so does the embedding lookup of a float32 engine
    # on the CPU (``BlasQuantizedEmbedding``; MLX's own lookup rounds to bf16 like ``mx.dequantize``): one set of
    # values for the tied weight, ``dequantize_int8g64(..., compute=True)``.
    torch = pytest.importorskip("torch", reason="the comparison needs torch")
    from transformers import AutoModelForCausalLM

    from stoa.weights.planes import bf16_bits_to_f32

    state = state_from_f32(tiny_weights, "int8g64")
    eng = MLXEngine(tiny_dir, dtype="float32")
    eng.load_state(state, "int8g64")
    lookup = state_to_f32(state, "int8g64")
    matmul = {}
    for k, v in state.items():
        if v.dtype == np.uint32:
            stem = k[: -len(".weight")]
            codes = v.astype("<u4").view(np.uint8).reshape(v.shape[0], -1, 64).astype(np.float32)
            s = bf16_bits_to_f32(state[stem + ".scales"])[..., None]
            b = bf16_bits_to_f32(state[stem + ".biases"])[..., None]
            matmul[k] = (codes * s + b).reshape(v.shape[0], -1)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    named = {k: torch.from_numpy(matmul.get(k, lookup[k])) for k in lookup}
    model.load_state_dict(named, strict=False)
    head = torch.from_numpy(matmul["model.embed_tokens.weight"])
    groups, _ = eng.generate(PROMPTS, 2, max_new_tokens=10, temperature=0.9, generator=1)
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for c in group:
            with torch.no_grad():
                h = model.model(torch.tensor([prompt + c.tokens])).last_hidden_state[0, len(prompt) - 1 : -1]
            ref = torch.log_softmax(h @ head.T / 0.9, -1).gather(-1, torch.tensor(c.tokens)[:, None])[:, 0]
            np.testing.assert_allclose(c.logprobs, ref.numpy(), atol=1e-4)


def test_load_weights_float32(tiny_dir, tiny_weights) -> None:
    eng = MLXEngine(tiny_dir, dtype="float32")
    w = _perturbed(tiny_weights, 3)
    eng.load_weights(w)
    got = _params(eng)
    for k, v in w.items():
        assert np.array_equal(got[k], v), k


def _bad_states(tiny_weights):
    good = state_from_f32(tiny_weights, "bf16")
    last = sorted(good)[-1]
    missing = dict(good)
    missing.pop("model.layers.1.mlp.down_proj.weight")
    extra = dict(good) | {"model.layers.9.mlp.up_proj.weight": good["model.norm.weight"]}
    tied_head = dict(good) | {"lm_head.weight": good["model.embed_tokens.weight"]}
    misshaped = dict(good) | {last: good[last][..., :-1]}
    wrong_dtype = dict(good) | {last: good[last].astype(np.float32)}
    return [
        (missing, "bf16", "model.layers.1.mlp.down_proj.weight"),
        (extra, "bf16", "model.layers.9.mlp.up_proj.weight"),
        (tied_head, "bf16", "lm_head.weight"),
        (misshaped, "bf16", last),
        (wrong_dtype, "bf16", last),
        (good, "fp8", "unknown weight plane"),
    ]


def test_bad_states_are_refused_naming_the_tensor_and_nothing_is_loaded(tiny_dir, tiny_weights) -> None:
    eng = MLXEngine(tiny_dir, dtype="float32")
    before = _params(eng)
    for state, plane, name in _bad_states(_perturbed(tiny_weights, 5)):
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            eng.load_state(state, plane)
        after = _params(eng)
        assert all(np.array_equal(before[k], after[k]) for k in before), f"partial load after {name}"


def test_bad_int8_states_are_refused(tiny_dir, tiny_weights) -> None:
    good = state_from_f32(tiny_weights, "int8g64")
    eng = MLXEngine(tiny_dir, dtype="float32")
    before = _params(eng)
    name = "model.layers.0.mlp.up_proj"
    no_biases = {k: v for k, v in good.items() if k != name + ".biases"}
    bad_codes = dict(good) | {name + ".weight": good[name + ".weight"].astype(np.int64)}
    short_scales = dict(good) | {name + ".scales": good[name + ".scales"][:-1]}
    norm_scales = dict(good) | {"model.norm.scales": good[name + ".scales"]}
    for state, match in [(no_biases, name + ".biases"), (bad_codes, name + ".weight"),
                         (short_scales, name + ".scales"), (norm_scales, "model.norm")]:
        with pytest.raises(ValueError, match=match.replace(".", r"\.")):
            eng.load_state(state, "int8g64")
        assert not any(isinstance(m, nn.QuantizedLinear) for _, m in eng.model.named_modules())
        after = _params(eng)
        assert all(np.array_equal(before[k], after[k]) for k in before)


def test_plane_switch_from_int8_to_bf16_is_refused(tiny_dir, tiny_weights) -> None:
    eng = MLXEngine(tiny_dir, dtype="float32")
    eng.load_state(state_from_f32(tiny_weights, "int8g64"), "int8g64")
    with pytest.raises(ValueError, match="int8g64"):
        eng.load_state(state_from_f32(tiny_weights, "bf16"), "bf16")
    eng.load_state(state_from_f32(_perturbed(tiny_weights), "int8g64"), "int8g64")  # same plane again is fine
