"""Import a GGUF checkpoint into a plain safetensors + tokenizer.json model directory."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import xxhash

from stoa.models.tiny import MARKER_FILE

GGUF_MAGIC = b"GGUF"
DTYPES = ("float32", "bfloat16", "float16")


def check_gguf_file(gguf_file: Path) -> Path:
    """Raise a clear error unless ``gguf_file`` is an existing file that starts with the GGUF magic.

    Args:
        gguf_file: Path to check.
    """
    path = Path(gguf_file).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if not path.is_file():
        raise ValueError(f"not a GGUF file: {path} is a directory")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"not a GGUF file: {path} starts with {magic!r}, expected {GGUF_MAGIC!r}")
    return path


def file_xxh3_128(path: Path) -> str:
    """xxh3_128 hex digest of a file's bytes.

    Args:
        path: The file.
    """
    h = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _mlx_friendly_config(config: dict[str, Any]) -> dict[str, Any]:
    """Mirror transformers 5's ``rope_parameters`` into the top-level keys mlx-lm and transformers 4 read.

    mlx-lm's llama/qwen2 ignore ``rope_parameters`` and would silently fall back to their default theta.
    """
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            config.setdefault("rope_scaling", dict(rope))
    return config


def _portable_tokenizer_config(config: dict[str, Any]) -> dict[str, Any]:
    """Name a class every transformers version knows (5.x writes its internal ``TokenizersBackend``)."""
    if config.get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):  # load-time arguments, not tokenizer properties
        config.pop(key, None)
    return config


def _rewrite_json(path: Path, fix: Any) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps(fix(data), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _convert(gguf_path: Path, out: Path, dtype: str) -> None:
    """Dequantize ``gguf_path`` with transformers' GGUF reader and save model + tokenizer into ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    torch_dtype = getattr(torch, dtype)
    folder, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    # from_pretrained(gguf_file=...) would need accelerate and, in transformers 5, attaches a GGUF quantizer
    # that refuses save_pretrained; reading the tensors ourselves with transformers' own GGUF reader gives
    # the identical dequantized weights.
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    parsed = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch_dtype
    )
    result = model.load_state_dict(parsed["tensors"], strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(result.missing_keys) - tied)
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{gguf_path.name}: GGUF tensors do not match {type(model).__name__}: "
            f"missing {missing[:5]}, unexpected {list(result.unexpected_keys)[:5]}"
        )
    if tied:
        model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out, save_jinja_files=False)
    _rewrite_json(out / "config.json", _mlx_friendly_config)
    _rewrite_json(out / "tokenizer_config.json", _portable_tokenizer_config)


def import_gguf(gguf_file: Path, out_dir: Path, *, dtype: str = "float32") -> Path:
    """Convert a GGUF file into a model directory that transformers and mlx-lm both load.

    Quantized tensors (Q4_1, Q8_0, ...) are dequantized. The directory gets ``config.json`` (with
    ``rope_theta`` at top level for mlx-lm), ``model.safetensors``, ``tokenizer.json``,
    ``tokenizer_config.json`` (with the chat template) and a ``stoa-model.json`` marker. It is written
    into a temporary sibling and renamed into place, so ``out_dir`` is either absent or complete.

    Args:
        gguf_file: The ``.gguf`` file.
        out_dir: Destination directory; must not exist yet.
        dtype: Storage dtype of the weights: 'float32', 'bfloat16' or 'float16'.

    Returns:
        ``out_dir``.
    """
    gguf_path = check_gguf_file(gguf_file)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out_dir = Path(out_dir).expanduser()
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it or choose another output directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _convert(gguf_path, tmp, dtype)
        marker = {
            "source": "gguf",
            "gguf_file": gguf_path.name,
            "gguf_xxh3_128": file_xxh3_128(gguf_path),
            "dtype": dtype,
        }
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        for f in tmp.iterdir():  # transformers writes some files 0600; a model dir is not a secret
            os.chmod(f, 0o644)
        os.chmod(tmp, 0o755)
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def dir_size_bytes(path: Path) -> int:
    """Total size of the regular files under ``path``.

    Args:
        path: A directory.
    """
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def import_gguf_cli(gguf_file: str, out_dir: str) -> int:
    """``stoa model import-gguf``: convert, print the result, return an exit code (0 ok, 1 error).

    Args:
        gguf_file: Path of the ``.gguf`` file.
        out_dir: Destination directory (must not exist).
    """
    t0 = time.monotonic()
    try:
        out = import_gguf(Path(gguf_file), Path(out_dir))
    except (OSError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    size_mb = dir_size_bytes(out) / 1e6
    print(f"imported {gguf_file} -> {out} ({size_mb:.0f} MB, {time.monotonic() - t0:.1f}s)")
    return 0
