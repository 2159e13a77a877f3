"""Tiny random qwen3, qwen3-moe, lfm2, lfm2-moe, qwen3.5 and qwen3.5-moe models (numpy only, no torch).

The reference runs train MoE and hybrid models (short convolutions, gated-delta linear attention); these
tiny configs give every engine, the trainer and the weight planes one small model per family to test on.
Each config is the smallest that still exercises what makes the family different (an MoE layer with 4
experts routed top-2, a conv layer next to an attention layer, a linear-attention layer next to a full one).

Weights are written in the on-disk naming of the family's real checkpoints, which both transformers 5
(through its checkpoint conversion mapping) and mlx-lm (through ``Model.sanitize``) load:

* qwen3-moe: per-expert ``mlp.experts.N.{gate,up,down}_proj.weight``;
* lfm2-moe: per-expert ``feed_forward.experts.N.{w1,w3,w2}.weight`` plus ``feed_forward.expert_bias``;
* qwen3.5-moe: fused 3-D ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]``;
* lfm2 / qwen3.5 convolutions in torch's ``Conv1d`` layout ``[C, 1, K]`` (mlx-lm transposes on load);
* qwen3.5 RMSNorm weights as offsets from 1 (``(1 + w) * x``), except the gated norm inside linear attention.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: Architectures built here (model_type spelling); tiny.py builds 'llama' and 'qwen2' itself.
FAMILY_ARCHS = ("qwen3", "qwen3_moe", "lfm2", "lfm2_moe", "qwen3_5", "qwen3_5_moe")

_HIDDEN = 64
_EXPERTS, _TOP_K, _MOE_INTER = 4, 2, 32


def _base(vocab_size: int, theta: float) -> dict[str, Any]:
    """Fields every family shares: the tiny tokenizer's ids, float32, tied embeddings, both rope spellings."""
    return {
        "hidden_size": _HIDDEN,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": "float32",
        "rope_theta": theta,
        "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
    }


def _moe_fields() -> dict[str, Any]:
    return {
        "num_experts": _EXPERTS,
        "num_experts_per_tok": _TOP_K,
        "moe_intermediate_size": _MOE_INTER,
        "norm_topk_prob": True,
        "output_router_logits": False,
    }


def _qwen3(vocab_size: int, moe: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if moe else "qwen3",
        **_base(vocab_size, 1000000.0),
        "num_hidden_layers": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 2,
    }
    if moe:
        cfg.update(_moe_fields(), decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001)
    return cfg


def _lfm2(vocab_size: int, moe: bool) -> dict[str, Any]:
    layer_types = ["conv", "full_attention", "conv"]
    cfg: dict[str, Any] = {
        "architectures": ["Lfm2MoeForCausalLM" if moe else "Lfm2ForCausalLM"],
        "model_type": "lfm2_moe" if moe else "lfm2",
        **_base(vocab_size, 1000000.0),
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "full_attn_idxs": [i for i, t in enumerate(layer_types) if t == "full_attention"],
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
    }
    if moe:
        cfg.update(_moe_fields(), num_dense_layers=1, use_expert_bias=True, routed_scaling_factor=1.0)
    else:
        # auto-adjust off: transformers and mlx-lm round the adjusted width differently.
        cfg.update(block_dim=_HIDDEN, block_ff_dim=128, block_multiple_of=32, block_ffn_dim_multiplier=1.0,
                   block_auto_adjust_ff_dim=False)
    return cfg


def _qwen3_5(vocab_size: int, moe: bool) -> dict[str, Any]:
    """A qwen3.5 text config nested as ``text_config`` (the checkpoints' layout, which both libraries read)."""
    theta = 10000000.0
    layer_types = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    text: dict[str, Any] = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        **_base(vocab_size, theta),
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "full_attention_interval": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        # Text-only positions make mrope plain rope; the sections cover the 2 frequencies of a 4-dim rotary.
        "rope_parameters": {"rope_theta": theta, "rope_type": "default", "partial_rotary_factor": 0.25,
                            "mrope_section": [1, 1, 0], "mrope_interleaved": True},
        "partial_rotary_factor": 0.25,
    }
    if moe:
        text.update(_moe_fields(), decoder_sparse_step=1, mlp_only_layers=[], shared_expert_intermediate_size=32,
                    router_aux_loss_coef=0.001)
    return {
        "architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def family_config(arch: str, vocab_size: int) -> dict[str, Any]:
    """The ``config.json`` of the tiny model for one of :data:`FAMILY_ARCHS`."""
    builders = {"qwen3": _qwen3, "lfm2": _lfm2, "qwen3_5": _qwen3_5}
    base = arch.removesuffix("_moe")
    if arch not in FAMILY_ARCHS:
        raise ValueError(f"unknown tiny family {arch!r}; expected one of {', '.join(FAMILY_ARCHS)}")
    return builders[base](vocab_size, base != arch)


class _Init:
    """Draws every tensor from one PCG64 stream in a fixed order, so a seed gives the same bits everywhere."""

    def __init__(self, seed: int, hidden: int) -> None:
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.h = hidden

    def normal(self, shape: tuple[int, ...], std: float) -> np.ndarray:
        return (self.rng.standard_normal(shape) * std).astype(np.float32)

    def linear(self, out_dim: int, in_dim: int) -> np.ndarray:
        return self.normal((out_dim, in_dim), in_dim**-0.5)

    def norm(self, dim: int | None = None, *, offset: bool = False) -> np.ndarray:
        """An RMSNorm weight near 1; ``offset`` stores it as ``w - 1`` for norms computing ``(1 + w) * x``."""
        return (float(not offset) + self.normal((dim or self.h,), 0.1)).astype(np.float32)

    def glu(self, p: str, inter: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> dict:
        """A SwiGLU block's three linears, named (gate, up, down) in the family's spelling."""
        gate, up, down = names
        return {f"{p}{gate}.weight": self.linear(inter, self.h), f"{p}{up}.weight": self.linear(inter, self.h),
                f"{p}{down}.weight": self.linear(self.h, inter)}

    def router(self, p: str, n_experts: int) -> dict:
        # Wide router logits (std ~2) spread tokens over different expert pairs and keep the top-k far from ties.
        return {f"{p}gate.weight": self.normal((n_experts, self.h), 2.0 * self.h**-0.5)}


def _attention(ini: _Init, p: str, cfg: dict[str, Any], *, lfm2: bool = False, gated_q: bool = False) -> dict:
    """Self-attention with per-head q/k norms (qwen3 names, or lfm2's ``out_proj``/``*_layernorm``)."""
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or ini.h // nh
    out, qn, kn = ("out_proj", "q_layernorm", "k_layernorm") if lfm2 else ("o_proj", "q_norm", "k_norm")
    offset = gated_q  # qwen3.5 norms are (1 + w)
    return {
        f"{p}q_proj.weight": ini.linear(nh * hd * (2 if gated_q else 1), ini.h),
        f"{p}k_proj.weight": ini.linear(nkv * hd, ini.h),
        f"{p}v_proj.weight": ini.linear(nkv * hd, ini.h),
        f"{p}{out}.weight": ini.linear(ini.h, nh * hd),
        f"{p}{qn}.weight": ini.norm(hd, offset=offset),
        f"{p}{kn}.weight": ini.norm(hd, offset=offset),
    }


def _short_conv(ini: _Init, p: str, cfg: dict[str, Any]) -> dict:
    """LFM2's gated short convolution: in_proj to (B, C, x), depthwise conv over time, out_proj."""
    h, k = ini.h, cfg["conv_L_cache"]
    return {f"{p}in_proj.weight": ini.linear(3 * h, h), f"{p}conv.weight": ini.normal((h, 1, k), k**-0.5),
            f"{p}out_proj.weight": ini.linear(h, h)}


def _gated_delta(ini: _Init, p: str, cfg: dict[str, Any]) -> dict:
    """Qwen3.5's gated-delta-net linear attention (separate qkv / z / b / a input projections)."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd, vd, k = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    conv_dim = 2 * nk * kd + nv * vd
    return {
        f"{p}in_proj_qkv.weight": ini.linear(conv_dim, ini.h),
        f"{p}in_proj_z.weight": ini.linear(nv * vd, ini.h),
        f"{p}in_proj_b.weight": ini.linear(nv, ini.h),
        f"{p}in_proj_a.weight": ini.linear(nv, ini.h),
        f"{p}conv1d.weight": ini.normal((conv_dim, 1, k), k**-0.5),
        f"{p}dt_bias": (1.0 + ini.normal((nv,), 0.1)).astype(np.float32),
        f"{p}A_log": np.log(ini.rng.uniform(0.2, 1.0, (nv,))).astype(np.float32),
        f"{p}norm.weight": ini.norm(vd),
        f"{p}out_proj.weight": ini.linear(ini.h, nv * vd),
    }


def _experts(ini: _Init, p: str, cfg: dict[str, Any], names: tuple[str, str, str]) -> dict:
    """Per-expert SwiGLU weights ``{p}experts.N.<name>.weight``; transformers and mlx-lm both stack them."""
    w: dict[str, np.ndarray] = {}
    for e in range(cfg["num_experts"]):
        w.update(ini.glu(f"{p}experts.{e}.", cfg["moe_intermediate_size"], names))
    return w


def _fused_experts(ini: _Init, p: str, cfg: dict[str, Any]) -> dict:
    """Fused 3-D expert weights (qwen3.5-moe's checkpoint layout): gate rows first, then up rows."""
    n, inter, h = cfg["num_experts"], cfg["moe_intermediate_size"], ini.h
    return {f"{p}experts.gate_up_proj": ini.normal((n, 2 * inter, h), h**-0.5),
            f"{p}experts.down_proj": ini.normal((n, h, inter), inter**-0.5)}


def _qwen3_layers(ini: _Init, cfg: dict[str, Any]) -> dict:
    w: dict[str, np.ndarray] = {}
    moe = cfg["model_type"] == "qwen3_moe"
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ini.norm()
        w.update(_attention(ini, p + "self_attn.", cfg))
        w[p + "post_attention_layernorm.weight"] = ini.norm()
        if moe:
            w.update(ini.router(p + "mlp.", cfg["num_experts"]))
            w.update(_experts(ini, p + "mlp.", cfg, ("gate_proj", "up_proj", "down_proj")))
        else:
            w.update(ini.glu(p + "mlp.", cfg["intermediate_size"]))
    w["model.norm.weight"] = ini.norm()
    return w


def _lfm2_layers(ini: _Init, cfg: dict[str, Any]) -> dict:
    w: dict[str, np.ndarray] = {}
    moe = cfg["model_type"] == "lfm2_moe"
    ffn_names = ("w1", "w3", "w2")
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        w[p + "operator_norm.weight"] = ini.norm()
        if kind == "conv":
            w.update(_short_conv(ini, p + "conv.", cfg))
        else:
            w.update(_attention(ini, p + "self_attn.", cfg, lfm2=True))
        w[p + "ffn_norm.weight"] = ini.norm()
        if moe and i >= cfg["num_dense_layers"]:
            w.update(ini.router(p + "feed_forward.", cfg["num_experts"]))
            w[p + "feed_forward.expert_bias"] = ini.normal((cfg["num_experts"],), 0.02)
            w.update(_experts(ini, p + "feed_forward.", cfg, ffn_names))
        else:
            w.update(ini.glu(p + "feed_forward.", cfg["intermediate_size"], ffn_names))
    w["model.embedding_norm.weight"] = ini.norm()  # LFM2's final norm, despite the name
    return w


def _qwen3_5_layers(ini: _Init, cfg: dict[str, Any]) -> dict:
    w: dict[str, np.ndarray] = {}
    moe = cfg["model_type"] == "qwen3_5_moe_text"
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ini.norm(offset=True)
        if kind == "linear_attention":
            w.update(_gated_delta(ini, p + "linear_attn.", cfg))
        else:
            w.update(_attention(ini, p + "self_attn.", cfg, gated_q=True))
        w[p + "post_attention_layernorm.weight"] = ini.norm(offset=True)
        if moe:
            w.update(ini.router(p + "mlp.", cfg["num_experts"]))
            w.update(_fused_experts(ini, p + "mlp.", cfg))
            w.update(ini.glu(p + "mlp.shared_expert.", cfg["shared_expert_intermediate_size"]))
            w[p + "mlp.shared_expert_gate.weight"] = ini.linear(1, ini.h)
        else:
            w.update(ini.glu(p + "mlp.", cfg["intermediate_size"]))
    w["model.norm.weight"] = ini.norm(offset=True)
    return w


def family_weights(config: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights in the family's checkpoint naming for a :func:`family_config` config.

    Small embeddings (std 0.05, tied LM head) keep the model from echoing its input token, so a random tiny
    model samples a broad distribution, as the llama/qwen2 tiny models do.
    """
    cfg = config.get("text_config", config)
    ini = _Init(seed, cfg["hidden_size"])
    w = {"model.embed_tokens.weight": ini.normal((cfg["vocab_size"], cfg["hidden_size"]), 0.05)}
    layers = {"qwen3": _qwen3_layers, "lfm2": _lfm2_layers, "qwen3_5": _qwen3_5_layers}
    w.update(layers[config["model_type"].removesuffix("_moe")](ini, cfg))
    return w
