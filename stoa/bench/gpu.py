"""``stoa bench gpu``: the GPU check, one command that says what works on a CUDA machine.

Five items, each with a one-line verdict (``PASS``/``FAIL``) and its figures:

- ``trainer``: the trainer step in bf16 at world size 1 under ``torchrun`` (``stoa bench dist``): tokens/s, MFU;
- ``preflight``: the memory preflight's estimate against the measured peak of one ``stoa bench trainer`` step;
- ``decode``: the torch engine's decode tokens/s against HF ``generate`` on the same device and shape;
- ``pulse``: PULSE from device tensors: the bf16 bits cast on the device equal the CPU path's, the patch is the
  same bytes, applying it is bit-exact, and a torch engine on the device holds exactly the published bits;
- ``fleet``: a trainer and a torch worker on the device over a local bucket, learning the toy task.

The figures are goals' evidence, not pass marks: a verdict fails on an error or a broken promise (bits, learning),
and the MFU and decode goals are printed beside it. ``--device cpu --quick`` rehearses every item on the tiny
model here (a test runs it), so the first GPU run is not the first run. ``scripts/gpu_check.sh`` runs this on a
fresh GPU machine with the wheels it carries (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stoa.bench.gpu_items import WINDOW, check_pulse, fleet_args, fleet_learned
from stoa.bench.trainer import preflight_estimate

TAIL_LINES = 25
"""Lines of a failed command's output the check prints."""


@dataclass(frozen=True)
class Sizes:
    """The shapes every item runs (``--quick``: the tiny model, a few seconds each on a CPU)."""

    model: str
    groups: int
    n: int
    prompt_tokens: int
    tokens: int
    micro_batch: int
    repeats: int
    decode_batch: int
    fleet_steps: int


FULL = Sizes("llama-1b", groups=8, n=8, prompt_tokens=128, tokens=256, micro_batch=16, repeats=3,
             decode_batch=64, fleet_steps=20)
"""On one H200: a ~1.1B Llama (random, built locally), 64 rows of 384 tokens per step."""
QUICK = Sizes("tiny", groups=2, n=2, prompt_tokens=16, tokens=8, micro_batch=4, repeats=1, decode_batch=4,
              fleet_steps=20)
"""The rehearsal: the tiny model, every path exercised in about a minute on 2 CPU cores."""

MFU_GOAL = 0.35
DECODE_GOAL = 1.5


@dataclass(frozen=True)
class Verdict:
    """One item's outcome."""

    item: str
    ok: bool
    line: str
    """The one-line summary printed after ``PASS``/``FAIL``."""
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


class CheckFailed(RuntimeError):
    """An item's command failed; the message is its last output line."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``stoa bench gpu``.

    Args:
        p: the benchmark's parser.
    """
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a rehearsal) [default: cuda]")
    p.add_argument("--quick", action="store_true", help="the tiny model and small shapes (a rehearsal)")
    p.add_argument("--items", default="trainer,preflight,decode,pulse,fleet",
                   help="comma list of items to run [default: all five]")
    p.add_argument("--item-timeout", type=float, default=240.0, help="seconds each item may take [default: 240]")
    p.add_argument("--out", default="", help="append one JSON row per item to this file [default: none]")


def stoa_cmd(argv: Sequence[str], timeout: float) -> str:
    """Run ``python -m stoa ARGV`` and return its output; a failure raises ``CheckFailed`` with its last line.

    Args:
        argv: stoa's arguments.
        timeout: seconds.
    """
    return run_cmd([sys.executable, "-m", "stoa", *argv], timeout)


def _text(out: str | bytes | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def show_tail(label: str, text: str, n: int = TAIL_LINES) -> None:
    """Print the last ``n`` non-blank lines of a failed command's output to stderr (the log keeps them)."""
    lines = [ln for ln in text.splitlines() if ln.strip()][-n:]
    for ln in lines:
        print(f"  [{label}] {ln}", file=sys.stderr, flush=True)


def run_cmd(cmd: Sequence[str], timeout: float) -> str:
    """Run ``cmd``; return its output, or raise ``CheckFailed`` naming its exit and last output line.

    A failure also prints the output's last lines to stderr, so one run on a borrowed machine says why.
    """
    label = " ".join(cmd[2:5])
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=False)  # noqa: S603
    except subprocess.TimeoutExpired as e:
        show_tail(label, _text(e.stdout) + _text(e.stderr))
        raise CheckFailed(f"over its {timeout:.0f} s: {' '.join(cmd[2:6])} ...") from None
    if done.returncode:
        out = done.stdout + done.stderr
        show_tail(label, out)
        lines = [ln for ln in out.splitlines() if ln.strip()]
        raise CheckFailed(f"exit {done.returncode}: {lines[-1] if lines else '(no output)'}")
    return done.stdout


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON rows a benchmark appended to ``path`` (none if it wrote none)."""
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def check_trainer(s: Sizes, device: str, tmp: Path, timeout: float) -> Verdict:
    """The bf16 trainer step at world size 1 under torchrun (``stoa bench dist``)."""
    out = tmp / "dist.jsonl"
    argv = ["bench", "dist", "--nproc", "1", "--child", "--out", str(out), "--model", s.model, "--device", device,
            "--dtype", "bfloat16", "--groups", str(s.groups), "--n-samples", str(s.n), "--prompt-tokens",
            str(s.prompt_tokens), "--max-new-tokens", str(s.tokens), "--repeats", str(s.repeats), "--mode",
            "packed", "--micro-batch", str(s.micro_batch)]
    run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "stoa",
             "--", *argv], timeout)
    row = read_rows(out)[-1]
    mfu = row.get("mfu")
    goal = "" if mfu is None else f" (goal {100 * MFU_GOAL:.0f}%: {'met' if mfu >= MFU_GOAL else 'not met'})"
    line = (f"{row['params'] / 1e6:.0f}M params on {row['device_name']}: {row['step_s']:.3f} s/step, "
            f"{row['tokens_per_s']:.0f} tok/s, MFU {'-' if mfu is None else f'{100 * mfu:.1f}%'}{goal}, "
            f"peak {row['peak_gib'][0]:.2f} GiB")
    return Verdict("trainer", True, line, {k: row[k] for k in ("params", "device_name", "step_s", "tokens_per_s",
                                                               "mfu", "peak_gib")})


def check_preflight(s: Sizes, device: str, tmp: Path, timeout: float) -> Verdict:
    """The memory preflight's estimate against one measured ``stoa bench trainer`` step (bf16, packed)."""
    out = tmp / "trainer.jsonl"
    stoa_cmd(["bench", "trainer", "--model", s.model, "--device", device, "--dtype", "bfloat16", "--groups",
              str(s.groups), "--n-samples", str(s.n), "--prompt-tokens", str(s.prompt_tokens), "--max-new-tokens",
              str(s.tokens), "--modes", "packed", "--repeats", "1", "--micro-batch", str(s.micro_batch),
              "--kl-beta", "0", "--out", str(out)], timeout)
    row = read_rows(out)[-1]
    measured = float(row.get("peak_cuda_gb") or row["peak_rss_gb"])
    est = preflight_estimate(s.model, device, s.micro_batch, s.prompt_tokens, s.tokens)
    ratio = est.total / measured if measured else float("inf")
    ok = 0.5 <= ratio <= 2.0
    line = (f"estimated {est.total:.2f} GB vs measured {measured:.2f} GB "
            f"({'CUDA reserved' if row.get('peak_cuda_gb') else 'RSS'}; ratio {ratio:.2f}, within 0.5-2: "
            f"{'yes' if ok else 'no'}); {est.describe()}")
    return Verdict("preflight", ok, line, {"estimated_gb": est.total, "measured_gb": measured, "ratio": ratio})


def check_decode(s: Sizes, device: str, tmp: Path, timeout: float) -> Verdict:
    """The torch engine's decode against HF ``generate`` (``stoa bench rollout``; device ``auto`` picks CUDA)."""
    out = tmp / "rollout.jsonl"
    stoa_cmd(["bench", "rollout", "--model", s.model, "--engines", "torch,hf", "--batch", str(s.decode_batch),
              "--n-samples", "8" if s.decode_batch >= 8 else "1", "--max-new-tokens", str(s.tokens),
              "--prompt-len", str(s.prompt_tokens), "--repeats", str(max(2, s.repeats)), "--out", str(out)],
             timeout)
    rows = {r.get("engine"): r for r in read_rows(out)}
    ours, hf = rows["torch"]["tokens_per_s"], rows["hf"]["tokens_per_s"]
    ratio = ours / hf
    goal = f"goal {DECODE_GOAL}x: {'met' if ratio >= DECODE_GOAL else 'not met'}"
    line = f"torch engine {ours:.0f} tok/s vs HF generate {hf:.0f} tok/s: {ratio:.2f}x ({goal})"
    return Verdict("decode", True, line, {"torch_tok_s": ours, "hf_tok_s": hf, "ratio": ratio,
                                          "device": device})


def check_fleet(s: Sizes, device: str, tmp: Path, timeout: float) -> Verdict:
    """A trainer and a torch worker on ``device`` over a local bucket, the toy task: does the reward rise?"""
    bucket = tmp / "bucket"
    trainer_argv, worker_argv = fleet_args(str(bucket), device, s.fleet_steps)
    log = tmp / "worker.log"
    with open(log, "w", encoding="utf-8") as out:
        worker = subprocess.Popen([sys.executable, "-m", "stoa", *worker_argv], stdout=out,  # noqa: S603
                                  stderr=subprocess.STDOUT)
        try:
            stoa_cmd(trainer_argv, timeout)
        except CheckFailed:
            show_tail("worker", log.read_text(errors="replace"))
            raise
        finally:
            worker.terminate()
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
    learned = fleet_learned(bucket / "runs" / "gpu" / "metrics" / "trainer.jsonl")
    if not learned.ok:
        show_tail("worker", log.read_text(errors="replace"))
    line = (f"{learned.steps} steps on {device}: reward {learned.first:.2f} -> {learned.last:.2f} "
            f"(first vs last {WINDOW} steps), rejected {learned.rejected}")
    return Verdict("fleet", learned.ok, line, asdict(learned))


def check_pulse_item(s: Sizes, device: str, tmp: Path, timeout: float) -> Verdict:
    """PULSE from device tensors (``stoa.bench.gpu_items.check_pulse``), in this process."""
    f = check_pulse(s.model, device)
    line = (f"{f.tensors} tensors, {f.elements / 1e6:.0f}M elements: device cast == host ({f.cast_mismatches} "
            f"differ), patch bytes equal: {f.patch_same}, applied bit-exact: {f.applied_exact}, engine on {device} "
            f"holds the published bits ({f.engine_mismatches} differ); patch {f.patch_mb:.1f} MB, encode "
            f"{f.encode_s:.2f} s, apply {f.apply_s:.2f} s")
    return Verdict("pulse", f.ok, line, asdict(f))


ITEMS: dict[str, Callable[[Sizes, str, Path, float], Verdict]] = {
    "trainer": check_trainer, "preflight": check_preflight, "decode": check_decode,
    "pulse": check_pulse_item,
    "fleet": check_fleet,
}
"""Item name -> its check (sizes, device, a scratch directory, seconds allowed)."""


def run_item(name: str, s: Sizes, device: str, timeout: float) -> Verdict:
    """One item, its failure caught as a ``FAIL`` verdict naming the error (the next item still runs)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"stoa-gpu-{name}-") as tmp:
        try:
            v = ITEMS[name](s, device, Path(tmp), timeout)
        except Exception as e:  # noqa: BLE001 - the check reports every failure and goes on
            v = Verdict(name, False, f"{type(e).__name__}: {str(e).splitlines()[-1] if str(e) else ''}")
    return Verdict(v.item, v.ok, v.line, v.figures, time.perf_counter() - t0)


def environment_line(device: str) -> str:
    """torch, transformers and the device, as one line."""
    import torch
    import transformers

    name = torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else "cpu"
    return f"torch {torch.__version__}, transformers {transformers.__version__}, {name}"


def main(args: argparse.Namespace) -> int:
    """Run the chosen items in order, print a verdict line each and a summary; 0 when every item passed.

    Args:
        args: parsed flags (see ``add_arguments``).
    """
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("stoa bench gpu: no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine, or "
              "rehearse with --device cpu --quick", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.items.split(",") if n.strip()]
    unknown = [n for n in names if n not in ITEMS]
    if unknown:
        print(f"stoa bench gpu: unknown item(s) {unknown}; choose from {', '.join(ITEMS)}", file=sys.stderr)
        return 2
    sizes = QUICK if args.quick else FULL
    print(f"[gpu] {environment_line(args.device)}; model {sizes.model}", flush=True)
    verdicts = []
    for name in names:
        v = run_item(name, sizes, args.device, args.item_timeout)
        verdicts.append(v)
        print(f"{'PASS' if v.ok else 'FAIL'} {v.item:<9} {v.line} [{v.seconds:.0f} s]", flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps({"bench": "gpu", **asdict(v)}) + "\n")
    passed = sum(v.ok for v in verdicts)
    total_s = sum(v.seconds for v in verdicts)
    print(f"gpu_check: {passed}/{len(verdicts)} passed in {total_s:.0f} s "
          f"(median item {statistics.median(v.seconds for v in verdicts):.0f} s)")
    return 0 if passed == len(verdicts) else 1
