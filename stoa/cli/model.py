"""``stoa model``: import a GGUF into an HF directory, or pull a known model into the cache."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stoa.models import import_gguf_cli, pull_cli


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``model`` command with ``import-gguf`` and ``pull``.

    Args:
        sub: the top-level subparsers.
    """
    p = sub.add_parser("model", help="import or pull models", description=__doc__)
    msub = p.add_subparsers(dest="model_command", metavar="ACTION")
    msub.required = True
    imp = msub.add_parser("import-gguf", help="convert a GGUF file into an HF (safetensors) directory")
    imp.add_argument("file", help="the .gguf file")
    imp.add_argument("outdir", help="directory to create")
    imp.set_defaults(func=lambda a: _import(a))
    pull = msub.add_parser("pull", help="fetch and convert a known model into the cache (e.g. smollm2-135m)")
    pull.add_argument("name", help="a built-in name: smollm2-135m, or a tiny random model per family: tiny (llama), "
                                   "tiny-qwen2, tiny-qwen3, tiny-qwen3-moe, tiny-qwen3.5, tiny-qwen3.5-moe, tiny-lfm2, "
                                   "tiny-lfm2-moe")
    pull.set_defaults(func=lambda a: _pull(a))


def _import(args: argparse.Namespace) -> int:
    """Check the paths up front (exit 2 naming the fix), then convert."""

    problem = ""
    if not Path(args.file).is_file():
        problem = f"GGUF file {args.file!r} not found; give the path of a .gguf file"
    elif Path(args.outdir).exists():
        problem = f"{args.outdir!r} already exists; give a new directory to create (nothing is overwritten)"
    else:
        with open(args.file, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            problem = f"{args.file!r} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); give a .gguf file"
    if problem:
        print(f"stoa: {problem}", file=sys.stderr)
        return 2
    return import_gguf_cli(args.file, args.outdir)


def _pull(args: argparse.Namespace) -> int:

    return pull_cli(args.name)
