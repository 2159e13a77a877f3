"""``stoa export``: write a run's model as a Hugging Face directory (transformers and mlx-lm open it)."""

from __future__ import annotations

import argparse
import sys

EXIT_EXPORT_REFUSED = 8
"""Exit code of a refused export (``EXIT_CODES`` in stoa.cli); the message names why (unknown run, version
gone, OUT not empty)."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``export`` command.

    Args:
        sub: the top-level subparsers.
    """
    p = sub.add_parser(
        "export", help="write a run's model as a Hugging Face directory",
        description="Write config.json, the tokenizer files and model.safetensors of a run into OUT. "
                    "'published' rebuilds the exact published weights of a version (bfloat16; an "
                    "int8g64 plane is dequantized exactly); 'checkpoint' writes the trainer's float32 "
                    "master weights.")
    p.add_argument("out", metavar="OUT", help="directory to create (must be new or empty)")
    p.add_argument("--bucket", required=True, help="bucket URL or local directory of the run")
    p.add_argument("--run", required=True, help="run id")
    p.add_argument("--version", type=int, default=None,
                   help="version to export, --source published only [default: the newest published]")
    p.add_argument("--source", choices=("published", "checkpoint"), default="published",
                   help="published: the weights workers sample with; checkpoint: the trainer's fp32 master "
                        "weights [default: published]")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Export, printing progress lines and where the model is.

    Args:
        args: parsed arguments.
    """
    from stoa.bucket import open_bucket
    from stoa.export import ExportError, export_run

    try:
        result = export_run(open_bucket(args.bucket, create=False), args.run, args.out, version=args.version,
                            source=args.source)
    except ExportError as e:
        print(f"stoa export: {e}", file=sys.stderr)
        return EXIT_EXPORT_REFUSED
    print(f"[export] wrote v{result.version} ({result.source}, {result.dtype}, {result.tensors} tensors, "
          f"{result.nbytes / 1e6:.1f} MB) to {result.out}; load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained({str(result.out)!r}) or mlx_lm.load(...)")
    return 0
