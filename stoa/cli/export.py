"""``stoa export``: write a run's model as a Hugging Face directory (transformers and mlx-lm open it)."""

from __future__ import annotations

import argparse
import sys

from stoa.bucket import open_bucket
from stoa.config import ConfigError
from stoa.contract import RunNotFound
from stoa.export import export_run
from stoa.layout import contract_key
from stoa.models.hf_dir import ExportError

EXIT_EXPORT_REFUSED = 8
"""Exit code of a refused export (``EXIT_CODES`` in stoa.cli); the message names why (version gone, nothing
published yet, OUT not empty). An unknown run is ``RunNotFound`` (12), a flag conflict ``ConfigError`` (2)."""


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

    Raises:
        ConfigError: ``--version`` with ``--source checkpoint`` (exit 2).
        RunNotFound: the bucket holds no such run (exit 12).
    """

    if args.source == "checkpoint" and args.version is not None:
        raise ConfigError("version", "--version applies to --source published only (the checkpoint holds one "
                                     "version); drop --version, or use --source published")
    bucket = open_bucket(args.bucket, create=False)
    if not bucket.exists(contract_key(args.run)):
        raise RunNotFound(f"no run {args.run!r} in bucket {bucket.url} (no contract); check --run and --bucket")
    try:
        result = export_run(bucket, args.run, args.out, version=args.version, source=args.source)
    except ExportError as e:
        print(f"stoa export: {e}", file=sys.stderr)
        return EXIT_EXPORT_REFUSED
    print(f"[export] wrote v{result.version} ({result.source}, {result.dtype}, {result.tensors} tensors, "
          f"{result.nbytes / 1e6:.1f} MB) to {result.out}; load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained({str(result.out)!r}) or mlx_lm.load(...)")
    return 0
