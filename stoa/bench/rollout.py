"""`stoa bench rollout`: new tokens/s of our engines against mlx-lm batch_generate and HF generate."""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stoa.config.text import deprecated_flag
from stoa.engines.mlx_blas import blas_status, prepare_mlx_blas
from stoa.models.random_llama import resolve_bench_model

ENGINES = ("mlx", "mlx-lm", "torch", "torch-fp32", "hf", "hf-bf16")
"""``mlx``/``torch``: stoa's engines at the worker's default dtype (``dtype=auto``); ``torch-fp32``: the torch
engine forced to float32; ``mlx-lm``: ``mlx_lm.batch_generate``; ``hf``: transformers ``generate`` in float32
(bf16 on CUDA); ``hf-bf16``: ``generate`` with bf16 weights (its default attention)."""


RATIOS = (("torch", "hf"), ("torch", "hf-bf16"), ("torch-fp32", "hf"), ("mlx", "mlx-lm"))
"""(ours, baseline) pairs whose tokens/s ratio the table prints when both ran."""


class PeakRSS:
    """Samples this process's resident memory every few milliseconds while active; ``peak_mb`` is the max."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def current_mb() -> float:
        """Resident memory now (Linux ``/proc/self/statm``; elsewhere the process's lifetime peak)."""
        try:
            pages = int(Path("/proc/self/statm").read_text().split()[1])
            return pages * os.sysconf("SC_PAGE_SIZE") / 1e6
        except (OSError, ValueError, IndexError):
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return peak / 1e6 if sys.platform == "darwin" else peak / 1e3

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, self.current_mb())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakRSS:
        self.peak_mb = self.current_mb()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_mb = max(self.peak_mb, self.current_mb())


def bench_prompts(groups: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Deterministic prompts of random token ids (ids 3 and up: no special tokens), one per group.

    Args:
        groups: number of prompts.
        prompt_len: tokens per prompt.
        vocab: vocabulary size.
        seed: numpy seed.
    """

    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, prompt_len).tolist() for _ in range(groups)]


class _NoEOS:
    """The tokenizer ``mlx_lm.batch_generate`` needs, without stop tokens (so every row runs to length)."""

    eos_token_ids: list[int] = []

    def decode(self, ids: Sequence[int]) -> str:
        return ""


def _runner(engine: str, model_dir: Path, prompts: list[list[int]], n: int, tokens: int,
            threads: int = 0) -> Callable[..., dict]:
    """Build the engine and return ``run(share=True, max_new=tokens) -> {"new_tokens", "prefill_s"?, ...}``.

    Args:
        engine: one of :data:`ENGINES`.
        model_dir: model directory with weights.
        prompts: one prompt per group.
        n: rows per prompt (baselines get each prompt repeated n times).
        tokens: default new tokens per row.
        threads: torch CPU threads for ``torch``/``hf`` (0: torch's default).
    """
    if threads and engine.startswith(("torch", "hf")):
        import torch

        torch.set_num_threads(threads)
    rows = [p for p in prompts for _ in range(n)]
    if engine == "mlx":
        return _mlx_runner(model_dir, prompts, n, tokens)
    if engine in ("torch", "torch-fp32"):
        return _torch_runner(model_dir, prompts, rows, n, tokens, fp32=engine == "torch-fp32")
    if engine == "mlx-lm":
        return _mlx_lm_runner(model_dir, rows, tokens)
    if engine in ("hf", "hf-bf16"):
        return _hf_runner(model_dir, rows, tokens, bf16=engine == "hf-bf16")
    raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")


def _mlx_runner(model_dir: Path, prompts: list[list[int]], n: int, tokens: int) -> Callable[..., dict]:
    """stoa's MLX engine: n rows per prompt, the prompt's prefill shared or not."""
    from stoa.engines.mlx.engine import MLXEngine

    eng = MLXEngine(model_dir)

    def run_mlx(share: bool = True, max_new: int = tokens) -> dict:
        _, st = eng.generate(prompts, n, max_new_tokens=max_new, generator=0, share_prefix=share)
        return {"new_tokens": st.new_tokens, "prefill_s": st.prefill_s, "decode_s": st.decode_s,
                "mlx_peak_mb": st.extra["peak_memory_mb"], "dtype": eng.dtype_name}

    return run_mlx


def _torch_runner(model_dir: Path, prompts: list[list[int]], rows: list[list[int]], n: int, tokens: int,
                  fp32: bool) -> Callable[..., dict]:
    """stoa's torch engine (``dtype=auto``, or float32): n rows per prompt, or every row its own prompt."""
    import torch

    from stoa.engines.torch import TorchEngine

    teng = TorchEngine(model_dir, device="auto", dtype="float32" if fp32 else "auto")
    gen = torch.Generator(device=teng.device).manual_seed(0)

    def run_torch(share: bool = True, max_new: int = tokens) -> dict:
        if share:
            _, st = teng.generate(prompts, n, max_new_tokens=max_new, generator=gen)
        else:  # every row its own prompt: the same batched prefill, n times the rows
            _, st = teng.generate(rows, 1, max_new_tokens=max_new, generator=gen)
        return {"new_tokens": st.new_tokens, "prefill_s": st.prefill_s, "decode_s": st.decode_s,
                "dtype": str(teng.dtype).removeprefix("torch.")}

    return run_torch


def _mlx_lm_runner(model_dir: Path, rows: list[list[int]], tokens: int) -> Callable[..., dict]:
    """``mlx_lm.batch_generate`` on every row, in the dtype stoa's MLX engine would use."""

    prepare_mlx_blas()
    import mlx.core as mx
    from mlx_lm import batch_generate
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load_model

    from stoa.engines.mlx.engine import default_dtype

    model, _ = load_model(model_dir)
    model.set_dtype(mx.bfloat16 if default_dtype() == "bfloat16" else mx.float32)
    sampler = make_sampler(temp=1.0)

    def run_mlx_lm(share: bool = True, max_new: int = tokens) -> dict:
        mx.reset_peak_memory()
        out = batch_generate(model, _NoEOS(), rows, max_tokens=max_new, sampler=sampler,
                             return_token_ids=True, completion_batch_size=len(rows),
                             prefill_batch_size=len(rows))
        return {"new_tokens": sum(len(t) for t in out.token_ids or []),
                "prefill_s": out.stats.prompt_time, "decode_s": out.stats.generation_time,
                "mlx_peak_mb": mx.get_peak_memory() / 1e6, "dtype": default_dtype()}

    return run_mlx_lm


def _hf_runner(model_dir: Path, rows: list[list[int]], tokens: int, bf16: bool) -> Callable[..., dict]:
    """transformers ``generate`` on every row: float32 (bf16 on CUDA), or bf16 weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from stoa.engines.torch import resolve_device

    dev = resolve_device("auto")
    hf: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    bf16 = dev.type == "cuda" or bf16
    hf = hf.to(dev, torch.bfloat16 if bf16 else torch.float32).eval()
    ids = torch.tensor(rows, dtype=torch.long, device=dev)
    mask = torch.ones_like(ids)
    torch.manual_seed(0)

    def run_hf(share: bool = True, max_new: int = tokens) -> dict:
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                              top_k=0, max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0)
        return {"new_tokens": int((out.shape[1] - ids.shape[1]) * out.shape[0]),
                "dtype": str(hf.dtype).removeprefix("torch.")}

    return run_hf


def _sync_device(engine: str) -> None:
    if engine.startswith(("torch", "hf")):
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()


class EngineSession:
    """One engine built on the benchmark's model and prompts, answering timed runs (in this process).

    Args:
        engine: one of :data:`ENGINES`.
        model_dir: model directory with weights.
        batch: rows decoded together (G); ``batch // samples`` prompts of ``samples`` rows each.
        samples: rows per prompt (n); baselines get each prompt repeated n times.
        tokens: new tokens per row (EOS ignored).
        prompt_len: tokens per prompt.
        threads: torch CPU threads for ``torch``/``hf`` (0: torch's default, one per core).
    """

    def __init__(self, engine: str, model_dir: Path, batch: int, samples: int, tokens: int, prompt_len: int,
                 threads: int = 0):
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.prompts = bench_prompts(max(1, batch // samples), prompt_len, int(config["vocab_size"]))
        self.n = max(1, batch // len(self.prompts))
        self.engine = engine
        t0 = time.perf_counter()
        self._run = _runner(engine, Path(model_dir), self.prompts, self.n, tokens, threads)
        self.load_s = time.perf_counter() - t0
        self._run(max_new=4)  # warm-up: lazy init, kernels, allocator

    def ready(self) -> dict[str, Any]:
        """What the session is: rows, prompts, load time, BLAS or threads."""
        info: dict[str, Any] = {"engine": self.engine, "batch": len(self.prompts) * self.n,
                                "prompts": len(self.prompts), "samples": self.n, "load_s": self.load_s}
        if self.engine in ("mlx", "mlx-lm"):

            info["blas"] = blas_status()
        else:
            import torch

            info["threads"] = torch.get_num_threads()
        return info

    def call(self, share: bool = True, max_new: int | None = None) -> dict[str, Any]:
        """One timed run: wall seconds, new tokens, peak RSS during the run, and the engine's own figures.

        Args:
            share: our engines: share each prompt's prefill across its n rows (False: prefill every row).
            max_new: new tokens per row (default: the session's).
        """
        with PeakRSS() as rss:
            t0 = time.perf_counter()
            r = self._run(share=share) if max_new is None else self._run(share=share, max_new=max_new)
            _sync_device(self.engine)
            wall = time.perf_counter() - t0
        return r | {"wall_s": wall, "peak_rss_mb": rss.peak_mb, "load_avg": os.getloadavg()[0]}


class _Child:
    """An :class:`EngineSession` in its own Python process, driven over stdin/stdout with JSON lines."""

    def __init__(self, engine: str, model_dir: Path, batch: int, samples: int, tokens: int, prompt_len: int,
                 threads: int = 0):
        cmd = [sys.executable, "-m", "stoa.bench.rollout", "--serve", engine, "--model-dir", str(model_dir),
               "--batch", str(batch), "--n-samples", str(samples), "--max-new-tokens", str(tokens),
               "--prompt-len", str(prompt_len), "--threads", str(threads)]
        self.engine = engine
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)
        self.info = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        err = self.proc.stderr.read() if self.proc.stderr else ""
        raise RuntimeError(f"bench {self.engine} exited (code {self.proc.wait()}):\n{err[-3000:]}")

    def call(self, share: bool = True, max_new: int | None = None) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"share": share, "max_new": max_new}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _serve(engine: str, model_dir: Path, batch: int, samples: int, tokens: int, prompt_len: int,
           threads: int) -> None:
    """Child side of :class:`_Child`: print ``ready``, then one JSON result per JSON request line."""
    session = EngineSession(engine, model_dir, batch, samples, tokens, prompt_len, threads)
    print(json.dumps(session.ready()), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        print(json.dumps(session.call(bool(req.get("share", True)), req.get("max_new"))), flush=True)


def _summarise(info: dict[str, Any], runs: list[dict[str, Any]], prefill: dict[bool, list[float]],
               model_dir: Path, tokens: int, prompt_len: int) -> dict[str, Any]:
    tps = [r["new_tokens"] / r["wall_s"] for r in runs]
    row: dict[str, Any] = dict(info) | {
        "model": str(model_dir), "prompt_len": prompt_len, "new_tokens_per_row": tokens, "repeats": len(runs),
        "tokens_per_s": statistics.median(tps), "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
        "wall_s": statistics.median(r["wall_s"] for r in runs), "new_tokens": runs[0]["new_tokens"],
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "load_avg": statistics.median(r["load_avg"] for r in runs), "dtype": runs[0].get("dtype", "?"),
    }
    if "prefill_s" in runs[0]:
        row["prefill_s"] = statistics.median(r["prefill_s"] for r in runs)
        row["decode_tokens_per_s"] = statistics.median(r["new_tokens"] / r["decode_s"] for r in runs)
    if "mlx_peak_mb" in runs[0]:
        row["mlx_peak_mb"] = max(r["mlx_peak_mb"] for r in runs)
    if prefill[True]:
        row["prefill_shared_s"] = statistics.median(prefill[True])
        row["prefill_unshared_s"] = statistics.median(prefill[False])
    return row


def _environment() -> dict[str, Any]:

    return {"machine": platform.machine(), "system": platform.system(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "blas_mlx": blas_status()}


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The side-by-side table ``run_rollout_bench`` prints.

    Args:
        rows: one summary per engine, as :func:`run_rollout_bench` returns them.
    """
    head = (f"{'engine':<10} {'dtype':<8} {'G':>4} {'tok/s median (min-max)':>26} {'decode tok/s':>13} "
            f"{'prefill s':>10} {'shared/unshared prefill s':>26} {'peak RSS MB':>12} {'MLX peak MB':>12} "
            f"{'load':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        rng = f"{r['tokens_per_s']:.1f} ({r['tokens_per_s_min']:.1f}-{r['tokens_per_s_max']:.1f})"
        dec = f"{r['decode_tokens_per_s']:.1f}" if "decode_tokens_per_s" in r else "-"
        pre = f"{r['prefill_s']:.3f}" if "prefill_s" in r else "-"
        share = (f"{r['prefill_shared_s']:.3f} / {r['prefill_unshared_s']:.3f}"
                 if "prefill_shared_s" in r else "-")
        mlx_peak = f"{r['mlx_peak_mb']:.0f}" if "mlx_peak_mb" in r else "-"
        lines.append(f"{r['engine']:<10} {r.get('dtype', '?'):<8} {r['batch']:>4} {rng:>26} {dec:>13} "
                     f"{pre:>10} {share:>26} {r['peak_rss_mb']:>12.0f} {mlx_peak:>12} {r['load_avg']:>5.1f}")
    by_name = {r["engine"]: r for r in rows}
    for ours, theirs in RATIOS:
        if ours in by_name and theirs in by_name:
            ratio = by_name[ours]["tokens_per_s"] / by_name[theirs]["tokens_per_s"]
            lines.append(f"{ours} / {theirs}: {ratio:.2f}x (medians)")
    return "\n".join(lines)


def run_rollout_bench(
    model: str = "smollm2-135m",
    batch: int = 16,
    tokens: int = 128,
    repeats: int = 3,
    engines: Sequence[str] = ENGINES,
    *,
    samples: int = 8,
    prompt_len: int = 64,
    threads: int = 0,
    out: str | Path | None = "rollout-bench.jsonl",
    isolate: bool = True,
    echo: Callable[[str], Any] = print,
) -> list[dict[str, Any]]:
    """Measure new tokens/s of each engine on the same model, batch, prompts and length; print a table.

    Each engine runs in its own subprocess (``isolate``), so peak memory and thread pools are its own, and
    the engines take turns run by run (round robin), so a busy machine slows them alike. Every run decodes
    exactly ``tokens`` new tokens per row (EOS ignored). Figures are medians of ``repeats`` timed runs
    after a warm-up, with min-max; peak RSS is sampled during the runs. Our engines also report prefill
    time with each prompt's KV shared by its n rows versus prefilled once per row.

    Args:
        model: model name or directory (``resolve_bench_model``: also ``llama-1b``).
        batch: rows decoded together (G).
        tokens: new tokens per row.
        repeats: timed runs per engine (>= 3 for a median worth reading).
        engines: any of :data:`ENGINES`, in the order to run and print.
        samples: rows per prompt (n); the batch holds ``batch // samples`` prompts.
        prompt_len: prompt tokens.
        threads: torch CPU threads for ``torch`` and ``hf`` (0: torch's default). On a machine shared with
            other busy processes, 1 avoids OpenMP barrier stalls (see docs/mlx.md).
        out: JSONL file to append one line per engine to (None: do not write).
        isolate: run each engine in a subprocess (False: all in this process).
        echo: where the table goes.

    Returns:
        one result dict per engine (also written to ``out``).
    """

    _check(engines, batch, tokens, repeats, samples, prompt_len)
    model_dir = Path(resolve_bench_model(model))  # llama-1b: a random model built here
    env = _environment()
    sessions: list[Any] = []
    make = _Child if isolate else EngineSession
    try:
        for engine in engines:
            echo(f"[bench] starting {engine} (G={batch}, {tokens} new tokens) ...")
            sessions.append(make(engine, model_dir, batch, samples, tokens, prompt_len, threads))
        infos = [s.info if isinstance(s, _Child) else s.ready() for s in sessions]
        runs, prefill = _measure(sessions, list(engines), infos, repeats, echo)
    finally:
        for s in sessions:
            if isinstance(s, _Child):
                s.close()
    rows = []
    for info, rs, pf in zip(infos, runs, prefill, strict=True):
        row = _summarise(info, rs, pf, model_dir, tokens, prompt_len)
        rows.append(row | {"env": env, "time": time.time()})
    echo(format_table(rows))
    if out is not None:
        _append_jsonl(out, rows, echo)
    return rows


def _check(engines: Sequence[str], *sizes: int) -> None:
    """Refuse unknown engines and sizes below 1 (batch, tokens, repeats, samples, prompt_len)."""
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise ValueError(f"unknown engine(s) {unknown}; known: {', '.join(ENGINES)}")
    if min(sizes) < 1:
        raise ValueError("batch, tokens, repeats, samples and prompt_len must be >= 1")


def _append_jsonl(out: str | Path, rows: Sequence[dict[str, Any]], echo: Callable[[str], Any]) -> None:
    """Append one JSON line per row to ``out`` and say so."""
    with open(out, "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    echo(f"[bench] wrote {len(rows)} lines to {out}")


def _measure(sessions: Sequence[Any], engines: Sequence[str], infos: Sequence[dict[str, Any]], repeats: int,
             echo: Callable[[str], Any]) -> tuple[list[list[dict[str, Any]]], list[dict[bool, list[float]]]]:
    """Timed runs, round robin so load changes on the machine hit every engine alike; then, per round, our
    engines' prefill alone (one new token) with and without sharing each prompt's KV.

    Returns the runs per session and the prefill seconds per session (keyed by ``share``).

    Args:
        sessions: started sessions (in-process or children), one per engine.
        engines: their engine names.
        infos: what each session reported when ready.
        repeats: timed runs per engine.
        echo: progress output.
    """
    runs: list[list[dict[str, Any]]] = [[] for _ in sessions]
    prefill: list[dict[bool, list[float]]] = [{True: [], False: []} for _ in sessions]
    for rep in range(repeats):
        for i, s in enumerate(sessions):
            runs[i].append(s.call())
            echo(f"[bench] run {rep + 1}/{repeats} {engines[i]}: "
                 f"{runs[i][-1]['new_tokens'] / runs[i][-1]['wall_s']:.1f} tok/s")
        for i, s in enumerate(sessions):
            if engines[i] in ("mlx", "torch", "torch-fp32") and infos[i]["samples"] > 1:
                for share in (True, False):
                    prefill[i][share].append(s.call(share=share, max_new=1)["prefill_s"])
    return runs, prefill


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``stoa bench rollout`` (and of the ``--serve`` child each engine runs in).

    Args:
        p: the benchmark's parser.
    """

    p.add_argument("--model", default="smollm2-135m", help="model name or directory")
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--serve", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=16, help="rows decoded together (G); batch / n_samples prompts")
    p.add_argument("--n-samples", dest="samples", metavar="N", type=int, default=8,
                   help="rows per prompt (group size n)")
    p.add_argument("--max-new-tokens", dest="tokens", metavar="N", type=int, default=128,
                   help="new tokens per row (EOS ignored: every row decodes all of them)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine, after a warm-up (median, min-max)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads for torch/hf (0: torch's default)")
    p.add_argument("--engines", default=",".join(ENGINES), help="engines to run, comma-separated")
    p.add_argument("--out", default="rollout-bench.jsonl", help="JSONL file of the figures (empty: none)")
    deprecated_flag(p, "--samples", "--n-samples")
    deprecated_flag(p, "--tokens", "--max-new-tokens")


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``stoa bench rollout``: the whole benchmark, or one engine (``--serve``, the child the parent starts).

    Args:
        args: parsed flags (``add_arguments``), or command-line arguments (default ``sys.argv[1:]``).
    """
    if isinstance(args, argparse.Namespace):
        a = args
    else:
        p = argparse.ArgumentParser(prog="stoa bench rollout", description=__doc__)
        add_arguments(p)
        a = p.parse_args(args)
    if a.serve:
        if a.serve in ("mlx", "mlx-lm"):

            prepare_mlx_blas()  # before anything imports mlx
        _serve(a.serve, Path(a.model_dir), a.batch, a.samples, a.tokens, a.prompt_len, a.threads)
        return 0
    run_rollout_bench(a.model, a.batch, a.tokens, a.repeats, [e for e in a.engines.split(",") if e],
                      samples=a.samples, prompt_len=a.prompt_len, threads=a.threads, out=a.out or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
