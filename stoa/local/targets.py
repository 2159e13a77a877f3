"""Which linears of a decoder block get LoRA adapters and which stay float, for dense, MoE and hybrid blocks
(docs/local.md, "Which linears get adapters").

The rule reads module paths only (``self_attn.q_proj``, ``mlp.gate``, ``conv.in_proj``), so both backends,
whose module classes differ, pick the same linears, and the memory preflight counts them from config.json.
"""

from __future__ import annotations

from collections.abc import Sequence

from stoa.config.local import DENSE_TARGETS, lora_target_names

AUTO_TARGETS = (*DENSE_TARGETS, "out_proj", "in_proj", "in_proj_qkv", "in_proj_z", "in_proj_qkvz", "w1", "w3",
                "w2")
"""What ``lora_targets = "auto"`` adapts: attention projections (q/k/v/o, LFM2's ``out_proj``), the dense MLP
and the shared expert (gate/up/down, LFM2's w1/w3/w2), LFM2's short-convolution projections
(``conv.in_proj``/``conv.out_proj``) and the gated-delta projections of qwen3.5 / qwen3-next
(``in_proj_qkv``, ``in_proj_z`` or fused ``in_proj_qkvz``, ``out_proj``). Not the per-head decay/beta gates
``in_proj_a``/``in_proj_b``/``in_proj_ba``, never a router, never the routed experts."""

ROUTER_LEAVES = ("gate", "shared_expert_gate", "router")
"""Leaf names of MoE routers (``mlp.gate``, ``feed_forward.gate``, qwen's ``shared_expert_gate``): kept float
and never adapted, so the frozen base routes every token the same way in both backends."""

EXPERT_PARTS = ("experts", "switch_mlp")
"""Path parts of the routed experts (transformers' fused ``experts``, mlx-lm's ``switch_mlp``): quantized with
the base, never adapted."""


def is_router(path: str) -> bool:
    """Whether a module path inside a decoder layer is a MoE router.

    Args:
        path: e.g. ``mlp.gate`` (router) or ``mlp.gate_proj`` (not).
    """
    return path.rsplit(".", 1)[-1] in ROUTER_LEAVES


def is_expert(path: str) -> bool:
    """Whether a module path inside a decoder layer belongs to the routed experts.

    Args:
        path: e.g. ``mlp.switch_mlp.up_proj`` or ``mlp.experts``.
    """
    return any(part in EXPERT_PARTS for part in path.split("."))


def choose_targets(layer_linears: Sequence[Sequence[str]], spec: str) -> list[list[str]]:
    """Per decoder layer, the paths (inside the layer) of the linears that get adapters.

    'auto' takes :data:`AUTO_TARGETS`; a layer with none of them (a block of an unknown family) gets every
    linear that is not a router or an expert, as mlx-lm's own default does. 'all-linear' takes every linear but
    routers and experts; names match the last path component or the whole path (a named router is honoured).

    Args:
        layer_linears: per layer, the paths of its linear (or quantized linear) modules.
        spec: the ``lora_targets`` setting.

    Raises:
        ValueError: 'lora_targets: ...' when a named target matches nothing or a layer ends up without any.
    """
    names = lora_target_names(spec)
    out: list[list[str]] = []
    for i, paths in enumerate(layer_linears):
        plain = [p for p in paths if not is_router(p) and not is_expert(p)]
        if names == ("all-linear",):
            chosen = plain
        elif names == ("auto",):
            chosen = [p for p in plain if p.rsplit(".", 1)[-1] in AUTO_TARGETS] or plain
        else:
            chosen = [p for p in paths if p in names or p.rsplit(".", 1)[-1] in names]
        if not chosen:
            raise ValueError(f"lora_targets: layer {i} has no linear matching {spec!r} (it has {list(paths)})")
        out.append(sorted(chosen, key=_target_order))
    if names not in (("auto",), ("all-linear",)):
        found = {p for layer in out for p in layer} | {p.rsplit(".", 1)[-1] for layer in out for p in layer}
        missing = [n for n in names if n not in found]
        if missing:
            raise ValueError(f"lora_targets: {missing} match no linear in any layer")
    return out


def _target_order(path: str) -> tuple[int, str]:
    """Attention then MLP projections in ``DENSE_TARGETS`` order, other names after them (backends agree)."""
    leaf = path.rsplit(".", 1)[-1]
    return (DENSE_TARGETS.index(leaf) if leaf in DENSE_TARGETS else len(DENSE_TARGETS), path)
