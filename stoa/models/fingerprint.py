"""Model fingerprints: canonical hashes of what a model computes and what its token ids mean."""

from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import xxhash

# Config keys that change what a model computes. Anything else (dtype, transformers_version, _name_or_path,
# use_cache, initializer_range, token ids, ...) is ignored. rope_* keys are folded into one canonical "rope".
CONFIG_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "hidden_act",
    "hidden_activation",
    "rms_norm_eps",
    "layer_norm_eps",
    "layer_norm_epsilon",
    "tie_word_embeddings",
    "max_position_embeddings",
    "attention_bias",
    "mlp_bias",
    "qkv_bias",
    "partial_rotary_factor",
    "rotary_pct",
    "use_sliding_window",
    "sliding_window",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "num_dense_layers",
    "routed_scaling_factor",
    "use_expert_bias",
    # Hybrid stacks: which layers attend, and the convolution / linear-attention state they carry instead.
    "layer_types",
    "full_attn_idxs",
    "full_attention_interval",
    "conv_L_cache",
    "conv_bias",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_num_key_heads",
    "linear_value_head_dim",
    "linear_num_value_heads",
    "norm_eps",
    "block_dim",
    "block_ff_dim",
    "block_multiple_of",
    "block_ffn_dim_multiplier",
    "block_auto_adjust_ff_dim",
)

# Fields of tokenizer.json's "model" that change the id mapping (besides vocab and merges).
_TOKENIZER_MODEL_KEYS = (
    "type",
    "unk_token",
    "byte_fallback",
    "continuing_subword_prefix",
    "end_of_word_suffix",
    "fuse_unk",
)


@dataclass(frozen=True)
class ModelFingerprint:
    """What two processes must agree on to run "the same model".

    Attributes:
        architecture: ``architectures[0]`` of the config (or its ``model_type``).
        config_hash: xxh3_128 of the canonical compute-relevant config.
        tokenizer_hash: xxh3_128 of the canonical vocabulary, merges, special tokens and chat template.
        vocab_size: The config's ``vocab_size`` (number of rows of the embedding).
        weights_hash: xxh3_128 over all safetensors tensors, or None when not computed.
    """

    architecture: str
    config_hash: str
    tokenizer_hash: str
    vocab_size: int
    weights_hash: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (for the run contract)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelFingerprint:
        """Inverse of :meth:`to_dict`; unknown keys are an error.

        Args:
            data: A dict as written by :meth:`to_dict`.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model fingerprint fields: {', '.join(unknown)}")
        return cls(**data)


def _canonical_json(obj: Any) -> bytes:
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def _hash(obj: Any) -> str:
    return xxhash.xxh3_128_hexdigest(_canonical_json(obj))


def _norm_number(v: Any) -> Any:
    """Floats rounded to float32 (what both engines compute with; GGUF stores float32), integral ones as ints.

    So ``1e-5`` and GGUF's ``9.999999747378752e-06``, or ``10000`` and ``10000.0``, hash the same.
    """
    if isinstance(v, float) and math.isfinite(v):
        v = struct.unpack("<f", struct.pack("<f", v))[0]
        return int(v) if v.is_integer() else v
    if isinstance(v, dict):
        return {k: _norm_number(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_norm_number(x) for x in v]
    return v


def _canonical_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """One spelling of the rotary settings, whether written as transformers 4 or transformers 5 does."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope = {k: v for k, v in dict(params).items() if v is not None}
    if "type" in rope:
        rope.setdefault("rope_type", rope.pop("type"))
    rope.setdefault("rope_type", "default")
    top = cfg.get("rope_theta")
    if top is not None and "rope_theta" in rope and float(rope["rope_theta"]) != float(top):
        raise ValueError(
            f"config.json has rope_theta={top} but rope_parameters says {rope['rope_theta']}: "
            "transformers 5 reads the latter, mlx-lm the former, so the two engines would disagree"
        )
    if "rope_theta" not in rope and top is not None:
        rope["rope_theta"] = top
    return rope


def canonical_config(config: dict[str, Any]) -> dict[str, Any]:
    """The compute-relevant part of a ``config.json`` in canonical form (what ``config_hash`` hashes).

    Args:
        config: The parsed ``config.json``.
    """
    cfg = config
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    out: dict[str, Any] = {k: cfg[k] for k in CONFIG_KEYS if cfg.get(k) is not None}
    if "hidden_size" in out and "num_attention_heads" in out:
        out.setdefault("head_dim", out["hidden_size"] // out["num_attention_heads"])
        out.setdefault("num_key_value_heads", out["num_attention_heads"])
    if out.get("use_sliding_window") is False:  # the window size is then unused, and versions disagree on it
        out.pop("sliding_window", None)
    if set(out.get("layer_types") or ()) <= {"full_attention"}:  # transformers 5 writes it for dense models too
        out.pop("layer_types", None)
    out["rope"] = _canonical_rope(cfg)
    return _norm_number(out)


def _special_content(v: Any) -> Any:
    return v.get("content") if isinstance(v, dict) else v


def _chat_template(model_dir: Path, tok_cfg: dict[str, Any]) -> Any:
    """The chat template(s), whether in tokenizer_config.json or in chat_template.jinja/.json files."""
    tpl = tok_cfg.get("chat_template")
    if isinstance(tpl, list):  # [{"name": ..., "template": ...}, ...]
        tpl = {t["name"]: t["template"] for t in tpl}
    templates: dict[str, str] = dict(tpl) if isinstance(tpl, dict) else {}
    if isinstance(tpl, str):
        templates["default"] = tpl
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        templates.setdefault("default", jinja.read_text(encoding="utf-8"))
    legacy = model_dir / "chat_template.json"
    if legacy.exists() and "default" not in templates:
        templates["default"] = json.loads(legacy.read_text(encoding="utf-8"))["chat_template"]
    extra = model_dir / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            templates.setdefault(f.stem, f.read_text(encoding="utf-8"))
    return templates


def _drop_none(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _drop_none(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_drop_none(x) for x in v]
    return v


def canonical_tokenizer(model_dir: Path) -> dict[str, Any]:
    """The tokenizer in canonical form (what ``tokenizer_hash`` hashes).

    Vocabulary items are sorted by id, merges normalized to pairs, added tokens reduced to
    (id, content, special), special-token roles and chat templates taken from wherever this
    transformers version put them. Serialization details (key order, merges spelled "a b" or
    ["a", "b"], null fields) do not change the result.

    Args:
        model_dir: A model directory with ``tokenizer.json`` (and usually ``tokenizer_config.json``).
    """
    model_dir = Path(model_dir)
    tok_file = model_dir / "tokenizer.json"
    if not tok_file.exists():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json (only fast tokenizers are supported)")
    tok = json.loads(tok_file.read_text(encoding="utf-8"))
    cfg_file = model_dir / "tokenizer_config.json"
    tok_cfg: dict[str, Any] = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.exists() else {}

    model = dict(tok.get("model") or {})
    vocab = model.pop("vocab", None)
    if isinstance(vocab, dict):
        vocab_items: Any = sorted(([tid, t] for t, tid in vocab.items()), key=lambda x: (x[0], x[1]))
    else:  # Unigram: [[piece, score], ...] in id order
        vocab_items = vocab
    merges = model.pop("merges", None)
    if merges is not None:
        merges = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in merges]
    # "" and null mean the same for these; writers differ in which they emit.
    model_rest = {k: v for k, v in model.items() if k in _TOKENIZER_MODEL_KEYS and v not in (None, "")}
    added = sorted(
        ([a["id"], a["content"], bool(a.get("special", False))] for a in tok.get("added_tokens") or []),
        key=lambda x: x[0],
    )
    specials = {
        role: _special_content(tok_cfg.get(role))
        for role in ("bos_token", "eos_token", "pad_token", "unk_token")
        if tok_cfg.get(role) is not None
    }
    return {
        "model": model_rest,
        "vocab": vocab_items,
        "merges": merges,
        "added_tokens": added,
        "normalizer": _drop_none(tok.get("normalizer")),
        "pre_tokenizer": _drop_none(tok.get("pre_tokenizer")),
        "decoder": _drop_none(tok.get("decoder")),
        "special_tokens": specials,
        "chat_template": _chat_template(model_dir, tok_cfg),
    }


_SAFETENSORS_HEADER_MAX = 100 * 1024 * 1024


def weights_hash(model_dir: Path) -> str:
    """xxh3_128 over every tensor of the directory's ``*.safetensors`` files, in sorted name order.

    Each tensor contributes its name, dtype, shape and raw little-endian bytes, so the hash is the same
    however the tensors are sharded or ordered inside the files. Reads the safetensors header directly
    (no torch, no numpy; bf16 works).

    Args:
        model_dir: A directory with one or more ``*.safetensors`` files.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    index: dict[str, tuple[Path, dict[str, Any], int]] = {}
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > _SAFETENSORS_HEADER_MAX:
                raise ValueError(f"{f}: safetensors header too large ({n} bytes)")
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        for name, info in header.items():
            if name in index:
                raise ValueError(f"tensor {name!r} appears in both {index[name][0].name} and {f.name}")
            index[name] = (f, info, 8 + n)
    h = xxhash.xxh3_128()
    maps: dict[Path, mmap.mmap] = {}
    try:
        for name in sorted(index):
            f, info, base = index[name]
            if f not in maps:
                with open(f, "rb") as fh:
                    maps[f] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            start, end = info["data_offsets"]
            h.update(_canonical_json([name, info["dtype"], info["shape"], end - start]))
            with memoryview(maps[f]) as mv, mv[base + start : base + end] as chunk:
                h.update(chunk)
    finally:
        for m in maps.values():
            m.close()
    return h.hexdigest()


def model_fingerprint(model_dir: Path, *, with_weights: bool = False) -> ModelFingerprint:
    """Fingerprint a model directory (config.json + tokenizer files [+ safetensors]).

    Args:
        model_dir: The model directory.
        with_weights: Also hash the weights (reads every byte of the safetensors files).
    """
    model_dir = Path(model_dir)
    cfg_file = model_dir / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{model_dir} has no config.json")
    config = json.loads(cfg_file.read_text(encoding="utf-8"))
    canon = canonical_config(config)
    archs = config.get("architectures") or []
    return ModelFingerprint(
        architecture=str(archs[0] if archs else config.get("model_type", "unknown")),
        config_hash=_hash(canon),
        tokenizer_hash=_hash(canonical_tokenizer(model_dir)),
        vocab_size=int(canon.get("vocab_size", 0)),
        weights_hash=weights_hash(model_dir) if with_weights else None,
    )


def compare_fingerprints(expected: ModelFingerprint, actual: ModelFingerprint) -> list[str]:
    """Names of the fields that differ (empty when the models agree).

    ``weights_hash`` is compared only when both sides computed it.

    Args:
        expected: The fingerprint recorded in the run contract.
        actual: The fingerprint of the local model.
    """
    out = []
    for f in fields(ModelFingerprint):
        a, b = getattr(expected, f.name), getattr(actual, f.name)
        if f.name == "weights_hash" and (a is None or b is None):
            continue
        if a != b:
            out.append(f.name)
    return out
