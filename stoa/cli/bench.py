"""``stoa bench``: benchmarks that print figures (rollout engines, trainer step, PULSE, local mode), and the
peer comparisons and calibration harnesses of the checkout's ``benchmarks/`` folder."""

from __future__ import annotations

import argparse
import importlib
import logging
from types import ModuleType

from stoa.bench.checkout import load_script
from stoa.cli.parser import StoaParser, check_log_level
from stoa.config.text import HelpFormatter

BENCHES = {
    "rollout": ("stoa.bench.rollout", "new tokens/s of our engines vs mlx-lm and HF generate"),
    "trainer": ("stoa.bench.trainer", "trainer step time and tokens/s"),
    "checkpoint": ("stoa.bench.checkpoint", "checkpoint time on the trainer step's path, synchronous vs background"),
    "trl": ("trl_compare.py", "our trainer step vs TRL's GRPOTrainer, each in its own venv (checkout only)"),
    "gpu": ("stoa.bench.gpu", "the GPU check: trainer step and MFU, preflight vs peak, decode vs HF generate, PULSE "
            "from device tensors, a fleet that learns; a verdict per item (--device cpu --quick: a rehearsal)"),
    "dist": ("stoa.bench.dist", "FSDP2 data-parallel step: time, memory per rank, MFU, planes equal to 1 process"),
    "pulse": ("stoa.bench.pulse", "PULSE patch size, encode/apply speed, bit-exactness"),
    "local": ("stoa.bench.local", "single-process local mode vs mlxrl"),
    "logprobs": ("logprob_gap.py", "MLX vs torch logprob gap (bf16/int8 report; checkout only)"),
    "quarantine": ("quarantine_calibration.py",
                   "lag-0 logprob disagreement of honest and lying workers vs threshold (checkout only)"),
    "verify": ("stoa.bench.verify", "per-worker sequential test: false quarantines per engine pair (95% bound), "
               "records to detect per attack"),
    "retriever": ("stoa.bench.retriever", "BM25 queries/s (batched, single, HTTP) and index memory"),
    "episodes": ("stoa.bench.episodes", "multi-turn episode tokens/s (torch, MLX) on a real task vs generate"),
    "fleet": ("stoa.bench.fleet", "trainer intake (LIST/GET per step, seconds) vs simulated workers and window; "
              "--mix: a mixed fleet's pacing; --churn: throughput with workers joining and leaving"),
    "flood": ("stoa.bench.flood", "backpressure: groups written per group trained, peak objects, vs workers"),
    "pulse-experts": ("stoa.bench.pulse.experts", "PULSE patches on a MoE over real GRPO steps: ratio, sparsity by "
                      "tensor kind, untouched experts"),
    "families": ("family_drift.py", "ratio drift per model family: trainer fp32/bf16 vs torch and MLX workers, "
                 "MoE routing flips (checkout only)"),
}
"""Benchmark name: (module of the package, or script file of the checkout's ``benchmarks/``; one-line help)."""


def load_bench(name: str) -> ModuleType:
    """Benchmark ``name``'s module: imported from the package, or loaded by path from ``benchmarks/``.

    Args:
        name: a key of ``BENCHES``.

    Raises:
        BenchScriptMissing: a ``benchmarks/`` script that is not there (a wheel install).
    """
    target = BENCHES[name][0]
    return load_script(target) if target.endswith(".py") else importlib.import_module(target)


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``bench NAME [ARGS...]``; each benchmark parses its own flags (``stoa bench NAME --help``).

    Args:
        sub: the top-level subparsers.
    """
    p = sub.add_parser("bench", help="run a benchmark", description=__doc__,
                       epilog="benchmarks: " + "; ".join(f"{k}: {v[1]}" for k, v in BENCHES.items()))
    p.add_argument("bench", choices=sorted(BENCHES), help="which benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    p.set_defaults(func=run)


def bench_parser(name: str) -> argparse.ArgumentParser | None:
    """The parser of benchmark ``name`` (its ``add_arguments`` on a ``stoa bench NAME`` parser in the CLI's
    help style); None for a benchmark that parses its own flags in ``main(argv)``.

    Args:
        name: a key of ``BENCHES``.
    """

    help_text = BENCHES[name][1]
    mod = load_bench(name)
    if not hasattr(mod, "add_arguments"):
        return None
    bp = StoaParser(prog=f"stoa bench {name}", formatter_class=HelpFormatter,
                    description=(mod.__doc__ or help_text).strip())
    mod.add_arguments(bp)
    return bp


def run(args: argparse.Namespace) -> int:
    """Import the benchmark module lazily and hand it its flags.

    Args:
        args: parsed arguments.
    """
    mod = load_bench(args.bench)
    bench_args = take_global_flags(args)
    bp = bench_parser(args.bench)
    if bp is not None:
        return int(mod.main(bp.parse_args(bench_args)) or 0)
    return int(mod.main(bench_args) or 0)


def take_global_flags(args: argparse.Namespace) -> list[str]:
    """The benchmark's own flags, after taking out the global ``--debug`` and ``--log-level LEVEL`` (which
    ``stoa bench NAME ...`` would otherwise hand to the benchmark) and applying them to ``args``.

    Args:
        args: parsed arguments; ``args.args`` holds everything after the benchmark's name.

    Raises:
        ConfigError: ``--log-level`` is not a logging level.
    """


    rest: list[str] = []
    items = iter(args.args)
    for item in items:
        if item == "--debug":
            args.debug = True
        elif item == "--log-level" or item.startswith("--log-level="):
            args.log_level = item.partition("=")[2] or next(items, args.log_level)
            logging.getLogger().setLevel(check_log_level(args.log_level))
        else:
            rest.append(item)
    return rest
