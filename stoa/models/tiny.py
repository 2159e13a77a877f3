"""Tiny random models (llama, qwen2, and the families in tiny_families) with a real BPE tokenizer, built
bit-for-bit deterministically."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from stoa.models.tiny_families import FAMILY_ARCHS, family_config, family_weights

#: Bumped whenever the bytes :func:`make_tiny_model` writes change; caches built by another version rebuild.
TINY_BUILDER_VERSION = 2

#: Name of the marker file every model directory built or imported by stoa ends with.
MARKER_FILE = "stoa-model.json"

#: Every architecture :func:`make_tiny_model` builds; all but llama/qwen2 come from :mod:`stoa.models.tiny_families`.
TINY_ARCHS = ("llama", "qwen2", *FAMILY_ARCHS)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 512

# SmolLM2's ChatML template without its default system prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_PROSE = """\
You are a careful assistant. Read the question, think step by step, and give the final answer.
The answer is a number. Show the work first, then write the answer on its own line.
What is the sum of two numbers? Add them together. What is the difference? Subtract the smaller one.
A train leaves the station in the morning and travels for three hours at a steady speed.
There are apples and oranges in the basket; she takes some of them and gives the rest to her brother.
He buys pencils for the school, and each box costs the same amount of money.
If a number is multiplied by another number, the result is called the product.
Let us check the answer again to make sure that it is correct before we write it down.
The user asks a question and the assistant answers it with a short and clear explanation.
Thank you for the question. Here is how to solve the problem, one step at a time.
Every week the farmer carries vegetables to the market, where people pay for fresh food with cash.
The teacher writes a list of problems on the board and the students work on them in small groups.
Water flows from the river into the lake, and the birds fly over the green hills after the rain.
Remember that half of a number is the number divided by two, and a quarter is half of a half.
Please explain your reasoning, because an answer without any explanation is hard to trust.
The library opens early on weekdays and closes late; visitors can borrow up to five books each.
Our small company makes wooden chairs and tables, and every order is delivered within a month.
She walked around the garden twice, counting the flowers, the trees, and the stones along the path.
In the afternoon the children played outside while their parents prepared dinner in the kitchen.
"""

_NAMES = ("Tom", "Anna", "Maria", "James", "Lena", "Omar", "Sara", "Peter")
_ITEMS = ("apples", "books", "coins", "cookies", "marbles", "pencils", "stickers", "tickets")
_VERBS = ("buys", "finds", "gets", "loses", "sells", "gives away", "makes", "collects")


def _corpus() -> list[str]:
    """The fixed training text of the tiny tokenizer (prose plus templated arithmetic word problems)."""
    lines = _PROSE.splitlines() + ["system", "user", "assistant"] * 16
    for i, name in enumerate(_NAMES):
        for j, item in enumerate(_ITEMS):
            a, b = (7 * i + 3 * j) % 50 + 1, (5 * i + 11 * j) % 40 + 1
            verb = _VERBS[(i + j) % len(_VERBS)]
            lines.append(f"{name} has {a} {item} and {verb} {b} more. How many {item} does {name} have now?")
            lines.append(f"What is {a} + {b}? The answer is {a + b}. What is {a} * {b}? It is {a * b}.")
    return lines


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-to-printable-character table, indexed by byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _pre_tokenizer() -> Any:

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _train_bpe(lines: list[str], n_merges: int) -> list[tuple[str, str]]:
    """Learn ``n_merges`` byte-level BPE merges; ties go to the lexicographically smallest pair."""
    pre = _pre_tokenizer()
    words: Counter[tuple[str, ...]] = Counter()
    for line in lines:
        for piece, _ in pre.pre_tokenize_str(line):
            words[tuple(piece)] += 1
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:
            break
        merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for word, count in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return merges


def build_tiny_tokenizer() -> Any:
    """Build the tiny byte-level BPE tokenizer (a ``tokenizers.Tokenizer`` with exactly 512 ids).

    Ids 0..2 are ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``; 3..258 the 256 bytes in byte order;
    the rest are merges learned from a fixed corpus. Digits are always split into single tokens.
    """

    alphabet = _bytes_to_unicode()
    n_merges = VOCAB_SIZE - len(SPECIAL_TOKENS) - len(alphabet)
    merges = _train_bpe(_corpus(), n_merges)
    if len(merges) != n_merges:
        raise RuntimeError(f"tiny tokenizer corpus yields {len(merges)} merges, need {n_merges}")
    vocab: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *alphabet, *(a + b for a, b in merges)):
        if token in vocab:
            raise RuntimeError(f"duplicate token {token!r} in the tiny vocabulary")
        vocab[token] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def _tokenizer_config() -> dict[str, Any]:
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "added_tokens_decoder": added,
        "bos_token": "<|im_start|>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "model_max_length": 512,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<|endoftext|>",
    }


def tiny_config(arch: str = "llama") -> dict[str, Any]:
    """The ``config.json`` of the tiny model for ``arch`` (one of :data:`TINY_ARCHS`).

    Args:
        arch: 'llama' (SmolLM2-like, rope theta 1e4), 'qwen2' (q/k/v biases, rope theta 1e6), or a family
            of :data:`~stoa.models.tiny_families.FAMILY_ARCHS` (qwen3, MoE, LFM2 conv and qwen3.5 hybrids).
    """
    if arch in FAMILY_ARCHS:
        return family_config(arch, VOCAB_SIZE)
    common: dict[str, Any] = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "max_position_embeddings": 512,
        "vocab_size": VOCAB_SIZE,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if arch == "llama":
        theta = 10000.0
        cfg = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **common,
            "rms_norm_eps": 1e-5,
            "attention_bias": False,
            "mlp_bias": False,
            "pretraining_tp": 1,
        }
    elif arch == "qwen2":
        theta = 1000000.0
        cfg = {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            **common,
            "rms_norm_eps": 1e-6,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": 2,
        }
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {', '.join(TINY_ARCHS)}")
    # Both spellings: transformers 5 reads rope_parameters, mlx-lm and transformers 4 read rope_theta.
    cfg["rope_theta"] = theta
    cfg["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    return cfg


def tiny_weights(config: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights in transformers' naming for a tiny ``config`` (numpy only, no torch).

    Args:
        config: A config from :func:`tiny_config`.
        seed: Seed of numpy's PCG64 generator; the same seed gives the same bits on every platform.
    """
    if config["model_type"] in FAMILY_ARCHS:
        return family_weights(config, seed)
    rng = np.random.Generator(np.random.PCG64(seed))
    h, n_layers = config["hidden_size"], config["num_hidden_layers"]
    hd, nh, nkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    qkv_bias = config["model_type"] == "qwen2"

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        return normal((out_dim, in_dim), in_dim**-0.5)

    def norm() -> np.ndarray:
        return (1.0 + normal((h,), 0.1)).astype(np.float32)

    # Small embeddings keep the tied LM head from echoing its input token: a random tiny model then
    # samples a broad distribution, which RL smoke tests need for exploration.
    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal((vocab, h), 0.05)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = linear(nh * hd, h)
        w[p + "self_attn.k_proj.weight"] = linear(nkv * hd, h)
        w[p + "self_attn.v_proj.weight"] = linear(nkv * hd, h)
        if qkv_bias:
            w[p + "self_attn.q_proj.bias"] = normal((nh * hd,), 0.1)
            w[p + "self_attn.k_proj.bias"] = normal((nkv * hd,), 0.1)
            w[p + "self_attn.v_proj.bias"] = normal((nkv * hd,), 0.1)
        w[p + "self_attn.o_proj.weight"] = linear(h, nh * hd)
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "mlp.gate_proj.weight"] = linear(inter, h)
        w[p + "mlp.up_proj.weight"] = linear(inter, h)
        w[p + "mlp.down_proj.weight"] = linear(h, inter)
    w["model.norm.weight"] = norm()
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = normal((vocab, h), 0.5)
    return w


def _dump_json(obj: Any, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def make_tiny_model(out_dir: Path, arch: str = "llama", seed: int = 0) -> Path:
    """Write a tiny random model (config, float32 safetensors, tokenizer) into ``out_dir``.

    Needs only numpy, safetensors and tokenizers (no torch, no transformers), so a Mac worker can build it.
    The bytes written depend only on ``(arch, seed)`` and :data:`TINY_BUILDER_VERSION`. Both transformers
    (``AutoModelForCausalLM``/``AutoTokenizer``) and ``mlx_lm.load`` load the result.

    Args:
        out_dir: Directory to write into (created if missing; existing files of the same names are replaced).
        arch: One of :data:`TINY_ARCHS`.
        seed: Weight seed.

    Returns:
        ``out_dir``.
    """

    config = tiny_config(arch)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _dump_json(config, out_dir / "config.json")
    save_file(tiny_weights(config, seed), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    build_tiny_tokenizer().save(str(out_dir / "tokenizer.json"), pretty=True)
    _dump_json(_tokenizer_config(), out_dir / "tokenizer_config.json")
    _dump_json({"eos_token_id": 2, "pad_token_id": 0, "bos_token_id": 1}, out_dir / "generation_config.json")
    _dump_json(
        {"source": "tiny", "arch": arch, "seed": seed, "builder_version": TINY_BUILDER_VERSION},
        out_dir / MARKER_FILE,
    )
    return out_dir
