"""PULSE and the planes on MoE and hybrid models: 3-D expert tensors quantize like MLX's SwitchLinear, and
patches stay bit-exact after real GRPO steps, with untouched experts costing nothing."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from stoa.weights.anchor import decode_anchor, encode_anchor
from stoa.weights.planes import (
    dequantize_int8g64,
    is_quantized_name,
    quant_stem,
    quantize_int8g64,
    state_from_f32,
    state_to_f32,
)

needs_mlx = pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx not importable")
MOE_MODELS = ("tiny-qwen3-moe", "tiny-lfm2-moe", "tiny-qwen3.5-moe")


def test_quantized_tensors_of_the_new_families() -> None:
    # fused experts [E, out, in] (transformers 5 names them without .weight), per-expert and stacked names
    assert is_quantized_name("model.layers.0.mlp.experts.gate_up_proj", (4, 64, 64))
    assert is_quantized_name("model.layers.0.mlp.switch_mlp.up_proj.weight", (4, 32, 128))
    assert is_quantized_name("model.layers.0.mlp.experts.3.up_proj.weight", (32, 64))
    assert not is_quantized_name("model.layers.0.mlp.experts.down_proj", (4, 64, 32))  # in % 64 != 0
    # conv kernels [C, 1, K], linear-attention scalars, norms: bf16
    assert not is_quantized_name("model.layers.0.conv.conv.weight", (64, 1, 64))
    assert not is_quantized_name("model.layers.0.linear_attn.conv1d.weight", (128, 1, 4))
    assert not is_quantized_name("model.layers.0.linear_attn.A_log", (4,))
    assert not is_quantized_name("model.layers.0.linear_attn.dt_bias", (4,))
    assert not is_quantized_name("model.layers.0.linear_attn.norm.weight", (16,))
    # routers and hybrid projections are Linear layers: quantized like any other
    assert is_quantized_name("model.layers.0.mlp.gate.weight", (4, 64))
    assert is_quantized_name("model.layers.0.linear_attn.in_proj_qkv.weight", (128, 64))
    assert quant_stem("a.experts.gate_up_proj") == "a.experts.gate_up_proj"
    assert quant_stem("a.q_proj.weight") == "a.q_proj"


def test_3d_quantization_is_per_expert_2d() -> None:
    w = np.random.default_rng(0).standard_normal((3, 16, 128)).astype(np.float32)
    packed, scales, biases = quantize_int8g64(w)
    assert packed.shape == (3, 16, 32) and scales.shape == biases.shape == (3, 16, 2)
    deq = dequantize_int8g64(packed, scales, biases)
    for e in range(3):
        p, s, b = quantize_int8g64(w[e])
        assert np.array_equal(packed[e], p) and np.array_equal(scales[e], s) and np.array_equal(biases[e], b)
        assert np.array_equal(deq[e].view(np.uint32), dequantize_int8g64(p, s, b).view(np.uint32))


@pytest.mark.mlx
@needs_mlx
def test_3d_quantization_matches_mx_quantize_and_switch_linear() -> None:
    import mlx.core as mx
    from mlx_lm.models.switch_layers import SwitchLinear

    w = (np.random.default_rng(1).standard_normal((4, 32, 128)) * 0.05).astype(np.float32)
    q, s, b = mx.quantize(mx.array(w, dtype=mx.bfloat16), group_size=64, bits=8)
    state = state_from_f32({"l.experts.gate_up_proj": w}, "int8g64")
    assert np.array_equal(np.array(q), state["l.experts.gate_up_proj"])
    assert np.array_equal(np.array(s.view(mx.uint16)), state["l.experts.gate_up_proj.scales"])
    assert np.array_equal(np.array(b.view(mx.uint16)), state["l.experts.gate_up_proj.biases"])
    # the layout QuantizedSwitchLinear holds: loading our codes gives its parameter shapes exactly
    layer = SwitchLinear(128, 32, 4, bias=False).to_quantized(group_size=64, bits=8)
    layer.load_weights([("weight", mx.array(state["l.experts.gate_up_proj"])),
                        ("scales", mx.array(state["l.experts.gate_up_proj.scales"]).view(mx.bfloat16)),
                        ("biases", mx.array(state["l.experts.gate_up_proj.biases"]).view(mx.bfloat16))], strict=True)
    x = mx.array(np.random.default_rng(2).standard_normal((5, 1, 1, 128)).astype(np.float32))
    idx = mx.array(np.array([[0], [1], [2], [3], [1]], np.uint32))  # [tokens, top-k]
    got = np.array(layer(x, idx).astype(mx.float32)).reshape(5, 32)
    deq = state_to_f32(state, "int8g64")["l.experts.gate_up_proj"]
    want = np.stack([np.array(x).reshape(5, 128)[i] @ deq[int(e)].T for i, e in enumerate([0, 1, 2, 3, 1])])
    assert np.allclose(got, want, rtol=2e-2, atol=2e-2)


def test_state_round_trip_of_fused_experts_and_collisions() -> None:
    rng = np.random.default_rng(3)
    named = {"m.experts.gate_up_proj": rng.standard_normal((2, 8, 64)).astype(np.float32),
             "m.experts.down_proj": rng.standard_normal((2, 64, 32)).astype(np.float32),
             "m.conv.conv.weight": rng.standard_normal((64, 1, 3)).astype(np.float32)}
    q = state_from_f32(named, "int8g64")
    assert q["m.experts.gate_up_proj"].dtype == np.uint32 and q["m.experts.down_proj"].dtype == np.uint16
    assert q["m.conv.conv.weight"].dtype == np.uint16
    back = state_to_f32(q, "int8g64")
    assert back.keys() == named.keys() and back["m.experts.gate_up_proj"].shape == (2, 8, 64)
    with pytest.raises(ValueError, match="both quantize"):
        state_from_f32({"m.experts.gate_up_proj": named["m.experts.gate_up_proj"],
                        "m.experts.gate_up_proj.weight": np.zeros((2, 64), np.float32)}, "int8g64")


def test_tensor_kinds() -> None:
    from stoa.bench.pulse.experts import tensor_kind

    kinds = {
        "model.layers.0.mlp.experts.gate_up_proj": "expert",
        "model.layers.0.mlp.experts.gate_up_proj.scales": "expert",
        "model.layers.1.feed_forward.experts.down_proj": "expert",
        "model.layers.0.mlp.gate.weight": "router",
        "model.layers.0.mlp.gate.biases": "router",
        "model.layers.0.mlp.shared_expert_gate.weight": "router",
        "model.layers.0.mlp.shared_expert.up_proj.weight": "shared_expert",
        "model.layers.0.self_attn.q_proj.weight": "attention",
        "model.layers.0.self_attn.q_norm.weight": "norm",
        "model.layers.0.linear_attn.in_proj_qkv.weight": "linear_attention",
        "model.layers.0.linear_attn.conv1d.weight": "conv",
        "model.layers.0.conv.in_proj.weight": "conv",
        "model.layers.0.feed_forward.w1.weight": "mlp",
        "model.embed_tokens.weight": "embedding",
        "model.embedding_norm.weight": "norm",
    }
    assert {n: tensor_kind(n) for n in kinds} == kinds


@pytest.mark.parametrize("model", MOE_MODELS)
def test_patches_bit_exact_after_grpo_steps(stoa_cache, model) -> None:
    from stoa.bench.pulse.experts import run
    from stoa.models import resolve_model

    s = run(str(resolve_model(model, cache_dir=stoa_cache)), steps=2, lr=1e-4, planes=("bf16", "int8g64"),
            groups=1, n=2, new_tokens=3)
    assert len(s.steps) == 4
    for row in s.steps:
        assert row["bit_exact"], row
        assert row["changed_frac_by_kind"]["expert"] > 0  # the experts did train
        assert 0 < row["patch_bytes"] < row["state_bytes"]
        assert row["experts"]["changed_untouched"] == 0


def test_untouched_experts_cost_nothing(stoa_cache) -> None:
    from stoa.bench.pulse.experts import run
    from stoa.models import resolve_model

    s = run(str(resolve_model("tiny-qwen3-moe", cache_dir=stoa_cache)), steps=1, lr=1e-4, planes=("bf16",),
            groups=1, n=2, new_tokens=2, experts=32)
    ex = s.steps[0]["experts"]
    assert ex["experts"] == 64 and 0 < ex["touched"] < 40  # 2 layers x 32 experts; ~12 tokens route top-2
    assert ex["changed_untouched"] == 0 and ex["changed_touched"] > 0


@pytest.mark.parametrize("plane", ["bf16", "int8g64"])
def test_moe_anchor_round_trip(stoa_cache, plane) -> None:
    from safetensors.numpy import load_file

    from stoa.models import resolve_model

    d = resolve_model("tiny-qwen3.5-moe", cache_dir=stoa_cache)
    named = load_file(str(d / "model.safetensors"))
    state = state_from_f32(named, plane)
    data, manifest = encode_anchor(state, run_id="r", version=3, plane=plane)
    back = decode_anchor(bytearray(data), manifest, run_id="r", plane=plane, version=3)
    assert back.keys() == state.keys()
    assert all(back[k].shape == state[k].shape and back[k].tobytes() == state[k].tobytes() for k in state)
    assert back["model.layers.0.mlp.experts.gate_up_proj"].ndim == 3
