"""Model shapes for the memory preflight: the config.json figures of a model, read without loading (or
downloading) its weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoa.models import KNOWN_MODELS, default_cache_dir
from stoa.models.registry import SMOLLM2_DIR, resolve_model

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
    """The config.json figures the estimate needs, MoE and hybrid layers included.

    ``layer_kinds`` names each layer's token mixer (``attention``, ``conv`` for LFM2's short convolution,
    ``linear_attention`` for qwen3.5's gated delta rule); ``moe`` marks the layers whose MLP is a bank of
    ``experts`` routed top-``experts_per_tok`` (plus a shared expert of ``shared_intermediate`` when set).
    """

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
    layer_kinds: tuple[str, ...] = ()
    moe: tuple[bool, ...] = ()
    experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    conv_kernel: int = 0
    linear_heads: tuple[int, int, int, int] = (0, 0, 0, 0)
    """Gated-delta heads: (key heads, key head dim, value heads, value head dim)."""
    gated_q: bool = False
    """qwen3.5's attention: q_proj also emits an output gate (twice the query width)."""

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
            layers = int(c["num_hidden_layers"])
            kinds = _layer_kinds(c, layers)
            return cls(
                name=name, model_type=str(c.get("model_type", "?")), layers=layers,
                hidden=hidden, intermediate=_intermediate(c), vocab=int(c["vocab_size"]), heads=heads,
                kv_heads=int(c.get("num_key_value_heads") or heads), head_dim=int(c.get("head_dim") or hidden // heads),
                tied=bool(c.get("tie_word_embeddings", False)),
                max_positions=int(c.get("max_position_embeddings") or 1 << 20),
                hybrid=any(k != "attention" for k in kinds), layer_kinds=kinds, moe=_moe_layers(c, layers),
                experts=int(c.get("num_experts") or c.get("num_local_experts") or 0),
                experts_per_tok=int(c.get("num_experts_per_tok") or 0),
                moe_intermediate=int(c.get("moe_intermediate_size") or 0),
                shared_intermediate=int(c.get("shared_expert_intermediate_size") or 0),
                conv_kernel=int(c.get("conv_L_cache") or c.get("linear_conv_kernel_dim") or 0),
                linear_heads=(int(c.get("linear_num_key_heads") or 0), int(c.get("linear_key_head_dim") or 0),
                              int(c.get("linear_num_value_heads") or 0), int(c.get("linear_value_head_dim") or 0)),
                gated_q=str(c.get("model_type", "")).startswith("qwen3_5"))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{name}: config.json lacks a figure the memory estimate needs ({e})") from None

    def block_linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each dense decoder-block projection (an attention layer with a dense MLP)."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def kind(self, i: int) -> str:
        """Layer ``i``'s token mixer: ``attention``, ``conv`` or ``linear_attention``."""
        return self.layer_kinds[i] if self.layer_kinds else "attention"

    def is_moe(self, i: int) -> bool:
        """Whether layer ``i``'s MLP is routed experts."""
        return bool(self.moe) and self.moe[i] and self.experts > 0

    def layer_linears(self, i: int) -> dict[str, tuple[int, int]]:
        """(in, out) of layer ``i``'s linear modules by path, as the backends name them (routers included,
        routed experts not: see :meth:`expert_linears`)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        kind = self.kind(i)
        if kind == "conv":
            out = {"conv.in_proj": (h, 3 * h), "conv.out_proj": (h, h)}
        elif kind == "linear_attention":
            kh, kd, vh, vd = self.linear_heads
            out = {"linear_attn.in_proj_qkv": (h, 2 * kh * kd + vh * vd), "linear_attn.in_proj_z": (h, vh * vd),
                   "linear_attn.in_proj_b": (h, vh), "linear_attn.in_proj_a": (h, vh),
                   "linear_attn.out_proj": (vh * vd, h)}
        else:
            o = "self_attn.out_proj" if self.model_type.startswith("lfm2") else "self_attn.o_proj"
            out = {"self_attn.q_proj": (h, q * (2 if self.gated_q else 1)), "self_attn.k_proj": (h, kv),
                   "self_attn.v_proj": (h, kv), o: (q, h)}
        if not self.is_moe(i):
            i_ = self.intermediate
            return out | {"mlp.gate_proj": (h, i_), "mlp.up_proj": (h, i_), "mlp.down_proj": (i_, h)}
        out["mlp.gate"] = (h, self.experts)
        if self.shared_intermediate:
            s = self.shared_intermediate
            out |= {"mlp.shared_expert.gate_proj": (h, s), "mlp.shared_expert.up_proj": (h, s),
                    "mlp.shared_expert.down_proj": (s, h), "mlp.shared_expert_gate": (h, 1)}
        return out

    def expert_linears(self, i: int) -> dict[str, tuple[int, int]]:
        """(in, out) of ONE expert's projections in layer ``i`` (empty for a dense layer); every layer holds
        :attr:`experts` of them, each token runs :attr:`experts_per_tok`."""
        if not self.is_moe(i):
            return {}
        h, m = self.hidden, self.moe_intermediate
        return {"gate_proj": (h, m), "up_proj": (h, m), "down_proj": (m, h)}

    def layer_other_params(self, i: int) -> int:
        """Layer ``i``'s parameters outside linears: norms, conv kernels, gated-delta scalars."""
        qk_norm = self.kind(i) == "attention" and self.model_type.startswith(("qwen3", "lfm2"))
        n = 2 * self.hidden + (2 * self.head_dim if qk_norm else 0)
        if self.kind(i) == "conv":
            n += self.hidden * self.conv_kernel
        elif self.kind(i) == "linear_attention":
            kh, kd, vh, vd = self.linear_heads
            n += (2 * kh * kd + vh * vd) * self.conv_kernel + 2 * vh + vd
        return n

    def layer_params(self, i: int) -> int:
        """Every parameter of layer ``i``, all experts included."""
        lin = sum(a * b for a, b in self.layer_linears(i).values())
        experts = self.experts * sum(a * b for a, b in self.expert_linears(i).values())
        return lin + experts + self.layer_other_params(i)

    def params(self) -> int:
        """Total parameters (embeddings, blocks with every expert, norms, and the LM head when untied)."""
        blocks = sum(self.layer_params(i) for i in range(self.layers))
        return self.vocab * self.hidden * (1 if self.tied else 2) + blocks + self.hidden

    def active_intermediate(self) -> float:
        """MLP width a token runs through, averaged over layers (MoE: top-k experts plus the shared one)."""
        widths = [self.experts_per_tok * self.moe_intermediate + self.shared_intermediate if self.is_moe(i)
                  else self.intermediate for i in range(self.layers)]
        return sum(widths) / max(1, len(widths))

    def attention_layers(self) -> int:
        """Layers holding a KV cache (the others keep a fixed-size conv or recurrent state)."""
        return sum(1 for i in range(self.layers) if self.kind(i) == "attention")

    def state_values_per_row(self) -> int:
        """Values of fixed-size cache state per sequence over all conv and linear-attention layers."""
        kh, kd, vh, vd = self.linear_heads
        per = {"conv": self.hidden * self.conv_kernel,
               "linear_attention": (2 * kh * kd + vh * vd) * self.conv_kernel + vh * kd * vd, "attention": 0}
        return sum(per[self.kind(i)] for i in range(self.layers))


def _layer_kinds(c: dict[str, Any], layers: int) -> tuple[str, ...]:
    """Each layer's mixer from ``layer_types`` (lfm2 'conv', qwen3.5 'linear_attention'), else attention."""
    types = c.get("layer_types") or []
    kinds = tuple("conv" if t == "conv" else "linear_attention" if "linear" in str(t) else "attention"
                  for t in types)
    return kinds if len(kinds) == layers else ("attention",) * layers


def _moe_layers(c: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """Which layers route experts: lfm2-moe's first ``num_dense_layers`` are dense; qwen MoE skips
    ``mlp_only_layers`` and layers off ``decoder_sparse_step``."""
    if not (c.get("num_experts") or c.get("num_local_experts")):
        return (False,) * layers
    dense, step, only = int(c.get("num_dense_layers") or 0), int(c.get("decoder_sparse_step") or 1), set(
        c.get("mlp_only_layers") or [])
    return tuple(i >= dense and i not in only and (i + 1) % step == 0 for i in range(layers))


def _intermediate(c: dict[str, Any]) -> int:
    """The dense MLP width; LFM2 derives it from ``block_ff_dim`` when ``block_auto_adjust_ff_dim`` is set."""
    if c.get("block_auto_adjust_ff_dim") and c.get("block_ff_dim"):
        ff = int(float(c.get("block_ffn_dim_multiplier") or 1.0) * int(2 * int(c["block_ff_dim"]) / 3))
        mult = int(c.get("block_multiple_of") or 256)
        return mult * ((ff + mult - 1) // mult)
    return int(c["intermediate_size"] if c.get("intermediate_size") else c["block_ff_dim"])


def shape_for(model: str) -> ModelShape | None:
    """The model's shape without downloading anything: a local dir, a built-in, the HF cache or ``KNOWN_SHAPES``.

    Args:
        model: the ``model`` setting.

    Returns:
        the shape, or None when no config.json is reachable offline (resolve the model, then ``shape_from_dir``).
    """

    local = Path(model).expanduser()
    if (local / "config.json").is_file():
        return shape_from_dir(local, model)
    if model in KNOWN_MODELS:

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
