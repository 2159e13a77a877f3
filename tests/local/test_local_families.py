"""Local mode on MoE and hybrid families: which linears get adapters, quantized experts and float routers in
both backends, backends that agree, a real run per family, and a preflight that counts experts and hybrid layers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stoa.algorithms import get_algorithm
from stoa.algorithms.batch import micro_batches
from stoa.local.loop import make_backend, read_metrics, run_local
from stoa.local.preflight import adapter_params, estimate_memory
from stoa.local.targets import choose_targets
from stoa.models.shapes import ModelShape, shape_from_dir

from .conftest import sample_batch

QWEN3_MOE = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate",
             "mlp.switch_mlp.gate_proj", "mlp.switch_mlp.up_proj", "mlp.switch_mlp.down_proj"]
LFM2_CONV = ["conv.in_proj", "conv.out_proj", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2"]
LFM2_MOE_ATTN = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj",
                 "feed_forward.gate"]
QWEN35_MOE_LINEAR = ["linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                     "linear_attn.in_proj_a", "linear_attn.out_proj", "mlp.gate", "mlp.shared_expert.gate_proj",
                     "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj", "mlp.shared_expert_gate"]


def _dir(stoa_cache: Path, name: str) -> Path:
    from stoa.models import resolve_model

    return resolve_model(name, cache_dir=stoa_cache)


def test_auto_targets_per_block_kind():
    got = choose_targets([QWEN3_MOE, LFM2_CONV, LFM2_MOE_ATTN, QWEN35_MOE_LINEAR], "auto")
    assert got[0] == ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    assert got[1] == ["conv.in_proj", "conv.out_proj", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
    assert got[2] == ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"]
    assert got[3] == ["mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
                      "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj"]
    # all-linear: still never a router or an expert; a named router is honoured
    every = choose_targets([QWEN3_MOE, QWEN35_MOE_LINEAR], "all-linear")
    assert not any(p.endswith(("gate", "shared_expert_gate")) or "switch_mlp" in p for layer in every for p in layer)
    assert "linear_attn.in_proj_b" in every[1]
    assert choose_targets([QWEN3_MOE], "gate") == [["mlp.gate"]]


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-lfm2-moe", "tiny-qwen3.5-moe"])
def test_torch_experts_quantized_routers_float(stoa_cache, make_cfg, name):
    import torch
    from transformers import AutoModelForCausalLM

    from stoa.models.lora_torch import is_adapter
    from stoa.models.quant_torch import dequantize_affine, quantize_affine

    d = _dir(stoa_cache, name)
    be: object = make_backend(make_cfg(model=str(d), backend="torch"), d)
    base = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    model = be.model  # type: ignore[attr-defined]
    original = dict(base.named_parameters())
    checked = 0
    for n, p in model.named_parameters():
        p0 = original.get(n)
        if p0 is None:
            continue  # an adapter
        if ".experts." in n and p.ndim == 3 and p.shape[-1] % 64 == 0:
            rows = p0.detach().reshape(-1, p.shape[-1])
            want = dequantize_affine(*quantize_affine(rows, 4, 64)).reshape(p.shape)
            assert torch.equal(p.detach(), want), n  # the 4-bit values, exactly
            assert not torch.equal(p.detach(), p0.detach())
            checked += 1
        if n.endswith((".gate.weight", "shared_expert_gate.weight")):
            assert torch.equal(p.detach(), p0.detach()), n  # routers stay float
            checked += 1
    assert checked >= 2
    assert not any(p.requires_grad for n, p in model.named_parameters() if not is_adapter(n))


@pytest.mark.mlx
@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-lfm2", "tiny-qwen3.5-moe"])
def test_torch_and_mlx_agree_on_families(stoa_cache, make_cfg, mlx_available, name):
    """Same 4-bit base (experts included, routers float), same adapters: fp32 logprobs agree."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    d = _dir(stoa_cache, name)
    t = make_backend(make_cfg(model=str(d), backend="torch", kl_beta=0.0, lr=5e-2), d)
    m = make_backend(make_cfg(model=str(d), backend="mlx", dtype="float32"), d)
    assert t.summary.targets_per_layer == m.summary.targets_per_layer
    mods = dict(m.model.named_modules())  # type: ignore[attr-defined]
    assert all(type(v) is nn.Linear for k, v in mods.items() if k.endswith((".gate", "shared_expert_gate")))
    if "moe" in name:
        assert any(isinstance(v, QuantizedSwitchLinear) for v in mods.values())
    algo = get_algorithm(make_cfg(kl_beta=0.0).algo_config(), "torch")
    batch = sample_batch(t, algo)
    micro = micro_batches(len(batch), 0)
    batch.old_logp = t.logprobs(batch, micro)
    t.step(batch, micro, algo)
    theirs = t.adapter_arrays()  # qwen3.5 in mlx-lm sits under language_model.
    m.load_adapter_arrays({k: theirs[k.removeprefix("language_model.")] for k in m.adapter_arrays()})
    lt, lm = t.logprobs(batch, micro), m.logprobs(batch, micro)
    assert np.abs(lt - lm).max() < 1e-4, np.abs(lt - lm).max()
    np.testing.assert_allclose(m.ref_logprobs(batch, micro), t.ref_logprobs(batch, micro), atol=1e-4)


@pytest.mark.parametrize(("name", "backend"), [("tiny-qwen3-moe", "torch"), ("tiny-lfm2", "torch"),
                                               ("tiny-qwen3.5-moe", "torch"), ("tiny-qwen3-moe", "mlx"),
                                               ("tiny-lfm2", "mlx"), ("tiny-qwen3.5-moe", "mlx")])
def test_local_run_on_families(stoa_cache, make_cfg, tmp_path, name, backend):
    if backend == "mlx":
        pytest.importorskip("mlx.core", reason="needs mlx (mlx[cpu] on Linux)")
    d = _dir(stoa_cache, name)
    out = tmp_path / "run"
    cfg = make_cfg(model=str(d), backend=backend, steps=2, kl_beta=0.04, output_dir=str(out), lr=1e-2)
    summary = run_local(cfg, echo=lambda _s: None)
    assert summary["step"] == 2
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]
    assert len(rows) == 2 and all(np.isfinite(r["train/loss"]) for r in rows)
    assert all(r["rollout/decode_vs_forward_logp_max"] < 1e-3 for r in rows)  # the engine and the forward agree
    assert (out / "adapters" / "adapters.safetensors").is_file()


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3", "tiny-qwen3-moe", "tiny-lfm2", "tiny-lfm2-moe",
                                  "tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_shape_counts_every_parameter(stoa_cache, name):
    import torch
    from transformers import AutoModelForCausalLM

    d = _dir(stoa_cache, name)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert shape_from_dir(d).params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-lfm2", "tiny-lfm2-moe", "tiny-qwen3.5-moe"])
def test_preflight_adapters_are_the_backends(stoa_cache, make_cfg, name):
    d = _dir(stoa_cache, name)
    cfg = make_cfg(model=str(d), backend="torch")
    assert adapter_params(cfg, shape_from_dir(d)) == make_backend(cfg, d).summary.trainable_params


def _moe_config(experts: int) -> dict:
    """A Qwen3-MoE-like config (48 layers, 2048 wide, top-8) with ``experts`` experts."""
    return {"model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048, "intermediate_size": 6144,
            "vocab_size": 151936, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "tie_word_embeddings": False, "num_experts": experts, "num_experts_per_tok": 8,
            "moe_intermediate_size": 768, "decoder_sparse_step": 1, "mlp_only_layers": []}


def test_preflight_holds_all_experts_and_runs_top_k(make_cfg):
    cfg = make_cfg(backend="mlx", dtype="float32", quant_bits=4)
    small, big = ModelShape.from_config("a", _moe_config(64)), ModelShape.from_config("b", _moe_config(128))
    router = 48 * 64 * 2048  # 64 more router rows per layer
    assert big.params() - small.params() == 48 * 64 * 3 * 2048 * 768 + router  # every expert is held
    assert big.params() == 30_532_122_624  # Qwen3-30B-A3B's 30.5B
    assert small.active_intermediate() == big.active_intermediate() == 8 * 768  # a token runs top-k
    e_small, e_big = estimate_memory(cfg, small, "mlx"), estimate_memory(cfg, big, "mlx")
    extra = (48 * 64 * 3 * 2048 * 768 * (0.5 + 2 * 4 / 64) + router * 4) / 1e9  # 4-bit codes + fp32 scale/bias
    assert e_big.parts["weights"] - e_small.parts["weights"] == pytest.approx(extra, rel=1e-9)
    assert e_big.parts["train"] == e_small.parts["train"]


def test_preflight_hybrid_kv_only_on_attention_layers(make_cfg):
    cfg = make_cfg(backend="torch", groups_per_step=4, n_samples=8, max_new_tokens=512)
    dense = {"model_type": "lfm2", "num_hidden_layers": 16, "hidden_size": 1024, "intermediate_size": 4096,
             "vocab_size": 65536, "num_attention_heads": 16, "num_key_value_heads": 8, "conv_L_cache": 3}
    hybrid = dense | {"layer_types": ["conv", "conv", "full_attention", "conv"] * 4}
    a, h = ModelShape.from_config("a", dense), ModelShape.from_config("h", hybrid)
    assert h.attention_layers() == 4 and a.attention_layers() == 16
    assert estimate_memory(cfg, h, "torch").parts["rollout"] < estimate_memory(cfg, a, "torch").parts["rollout"]


@pytest.mark.parametrize("name", ["tiny-lfm2", "tiny-qwen3.5"])
def test_torch_reference_over_the_prompts_cache_equals_the_full_forward_on_hybrids(stoa_cache, make_cfg, name):
    """The reference runs each group's prompt once on hybrid stacks too (conv and linear-attention states repeated,
    the trainer's ``group_score``), within float32 noise of the full forward with the adapters bypassed."""
    d = _dir(stoa_cache, name)
    be: object = make_backend(make_cfg(model=str(d), backend="torch", kl_beta=0.04), d)
    algo = get_algorithm(make_cfg(kl_beta=0.04).algo_config(), "torch")
    batch = sample_batch(be, algo)
    micro = micro_batches(len(batch), 0)
    rng = np.random.default_rng(0)
    be.load_adapter_arrays({k: rng.standard_normal(v.shape).astype(np.float32) * 0.1  # type: ignore[attr-defined]
                            for k, v in be.adapter_arrays().items()})  # type: ignore[attr-defined]
    with be.adapters_disabled():  # type: ignore[attr-defined]
        full = be._score(batch, micro)  # type: ignore[attr-defined]
    np.testing.assert_allclose(be.ref_logprobs(batch, micro), full, atol=2e-5)  # type: ignore[attr-defined]
