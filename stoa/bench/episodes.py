"""``stoa bench episodes``: multi-turn rollout throughput of the torch and MLX engines on a real task with its
real tools (the built-in ``search`` task and its BM25 index by default), against single-turn ``generate`` on
the same prompts in the same run.

Each repeat runs, per engine, one seeded batch of P prompts x N episodes (``stoa.episodes.collect.sample_episodes``:
the engine's ``generate_episodes`` driven by ``EpisodeDriver``, every paused row's call in one tool request),
then ``generate`` on the same prompt tokens with ``max_new_tokens`` = the per-turn cap T twice:

- as workers run it (the denominator of the ratio): ``eos_ids`` = the codec's EOS ids, which is what the
  trainer writes into the contract (``contract.model.eos_token_ids``) and ``stoa.worker.loop`` passes, so a row
  that samples EOS leaves the batch, exactly as an episode row that ends does;
- with EOS ignored (a ceiling, never the ratio): every row decodes all T tokens in a full batch, the most
  tokens/s a batch of these rows can reach on this machine.

With ``--queue K`` a repeat runs K x P prompts: their episodes in one call on P x N decode slots (continuous
batching: a queued episode takes the slot of one that ended, the engines' ``decode_slots``) and
``generate`` on the same prompts as K batches of P, each as wide as the slots.

Engines alternate within a repeat, so load changes hit both alike; the table gives medians over repeats. The last
line printed, ``ratio_episode_vs_single=X``, is the lowest engine's median of the per-repeat ratio of multi-turn
action tokens/s to EOS-honoured ``generate`` tokens/s (observation tokens are prefilled, not counted as actions).
CPU seconds (``time.process_time``) are recorded beside wall seconds: on a shared machine the CPU-time ratio
(``episodes_vs_generate_cpu``) moves less with other processes' load than the wall ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stoa.config.text import deprecated_flag
from stoa.engines.factory import make_engine
from stoa.engines.mlx_blas import blas_status, prepare_mlx_blas
from stoa.episodes.collect import episode_metrics, sample_episodes
from stoa.episodes.task_tools import open_task_tools
from stoa.models import resolve_model
from stoa.rollouts.episode import ROLE_ACTION
from stoa.tasks import get_task
from stoa.tokenize import TextCodec

ENGINES = ("torch", "mlx")


@dataclass
class EpisodeBenchSpec:
    """What to measure.

    Args:
        model: model name or directory (``resolve_model``: ``tiny``, ``smollm2-135m``, a directory).
        engines: engines to run, in order (``torch``, ``mlx``).
        task: a multi-turn task name (``get_task``).
        options: the task's options (``KEY=VALUE`` strings converted by ``get_task``).
        prompts: prompts per batch (P), drawn from the task's train split with ``seed``.
        n: episodes per prompt (N).
        turn_tokens: tokens one model turn may sample (T); also ``generate``'s ``max_new_tokens``.
        repeats: timed batches per engine (R).
        threads: torch CPU threads (0: torch's default); MLX ignores it.
        dtype: compute dtype of both engines (``auto``, ``float32``, ``bfloat16``).
        temperature: sampling temperature.
        seed: the prompts' and the sampling seed (every repeat samples the same episodes).
        queue: batches of P x N episodes per repeat (K). Above 1, the K x P prompts' episodes run in one call
            with P x N decode slots (the engine's ``decode_slots``: continuous batching, a queued episode takes the
            slot of one that ended) and ``generate`` runs the same prompts as K batches of P (static batches of
            the same width, as a worker samples single turns); 1: one batch each, no queue.
    """

    model: str = "smollm2-135m"
    engines: tuple[str, ...] = ENGINES
    task: str = "search"
    options: tuple[str, ...] = ()
    prompts: int = 2
    n: int = 4
    turn_tokens: int = 48
    repeats: int = 2
    threads: int = 0
    dtype: str = "auto"
    temperature: float = 1.0
    seed: int = 0
    queue: int = 1

    @property
    def slots(self) -> int:
        """Rows decoding at once: the P x N of one batch."""
        return self.prompts * self.n

    def check(self) -> None:
        """Refuse unknown engines, dtypes and sizes below 1 (ValueError naming the field)."""
        unknown = [e for e in self.engines if e not in ENGINES]
        if unknown or not self.engines:
            raise ValueError(f"engines: {list(self.engines)} is not a subset of {', '.join(ENGINES)}; "
                             "pass e.g. --engines torch,mlx")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype: {self.dtype!r}; use auto, float32 or bfloat16")
        for name in ("prompts", "n", "turn_tokens", "repeats", "queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.threads < 0:
            raise ValueError(f"threads: must be >= 0 (0: torch's default), got {self.threads}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``stoa bench episodes``.

    Args:
        p: the subcommand's parser.
    """
    d = EpisodeBenchSpec()
    p.add_argument("--model", default=d.model, help=f"tiny, smollm2-135m or a model directory [default: {d.model}]")
    p.add_argument("--engines", default=",".join(d.engines), help="comma-separated: torch, mlx [default: torch,mlx]")
    p.add_argument("--task", default=d.task, help=f"a multi-turn task [default: {d.task}]")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a task option (repeatable), e.g. --option shots=0")
    p.add_argument("--prompts", type=int, default=d.prompts, help=f"prompts per batch P [default: {d.prompts}]")
    p.add_argument("--n-samples", dest="n", metavar="N",
                   type=int, default=d.n, help=f"episodes per prompt N [default: {d.n}]")
    deprecated_flag(p, "--n", "--n-samples")
    p.add_argument("--turn-tokens", type=int, default=d.turn_tokens,
                   help=f"tokens per model turn T, and generate's max_new_tokens [default: {d.turn_tokens}]")
    p.add_argument("--repeats", type=int, default=d.repeats, help=f"timed batches per engine R [default: {d.repeats}]")
    p.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads (0: torch's default)")
    p.add_argument("--dtype", default=d.dtype, choices=("auto", "float32", "bfloat16"),
                   help="compute dtype of both engines [default: auto]")
    p.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature [default: 1.0]")
    p.add_argument("--seed", type=int, default=d.seed, help="prompt and sampling seed [default: 0]")
    p.add_argument("--queue", type=int, default=d.queue, metavar="K",
                   help="batches of P x N episodes queued on P x N decode slots (generate runs K batches) "
                        f"[default: {d.queue}]")
    p.add_argument("--json", default="", metavar="PATH", help="also write the results here (JSON)")


def _episode_figures(eb: Any) -> dict[str, float]:
    """One episode batch's figures: tokens, rates, turns, tools and observation prefill."""


    eps = [e for g in eb.groups for e in g]
    action = float(sum(int(np.sum(np.asarray(e.roles) == ROLE_ACTION)) for e in eps))
    obs = float(sum(len(e.tokens) for e in eps)) - action
    wall = max(eb.seconds, 1e-9)
    extra = eb.stats.extra
    tool_s, obs_s = float(extra.get("tool_seconds", 0.0)), float(extra.get("obs_prefill_s", 0.0))
    out = {"wall_s": eb.seconds, "action_tokens": action, "obs_tokens": obs,
           "action_tokens_per_s": action / wall, "all_tokens_per_s": (action + obs) / wall,
           "tool_calls": float(extra.get("tool_calls", 0.0)), "tool_s": tool_s, "tool_share": tool_s / wall,
           "obs_prefill_s": obs_s, "obs_prefill_share": obs_s / wall,
           "rounds": float(extra.get("tool_requests", 0.0)),  # Tools.run requests, counted alike on both engines
           "steps": float(eb.stats.steps), "rows_per_step": eb.stats.new_tokens / max(eb.stats.steps, 1),
           "admitted": float(extra.get("admitted", 0.0)),  # rows that took a slot mid-flight (--queue)
           "reward_mean": float(np.mean([r for rs in eb.rewards for r in rs]))}
    out.update({k.removeprefix("rollout/"): v for k, v in episode_metrics(eb.groups).items()})
    return out


class EngineRun:
    """One engine on the benchmark's model, task, tools and prompts, answering timed repeats.

    Args:
        name: ``torch`` or ``mlx``.
        model_dir: the model directory.
        spec: the benchmark's settings.
        task: the task; tools: its tools; codec: the tokenizer; prompts: the batch's prompts.
    """

    def __init__(self, name: str, model_dir: Path, spec: EpisodeBenchSpec, task: Any, tools: Any, codec: Any,
                 prompts: Sequence[Any]):

        t0 = time.perf_counter()
        self.engine: Any = make_engine(name, model_dir, dtype=spec.dtype, threads=spec.threads)
        self.load_s = time.perf_counter() - t0
        self.name, self.spec, self.task, self.tools, self.codec = name, spec, task, tools, codec
        self.prompts = list(prompts)
        self.prompt_tokens = [codec.encode_prompt(p.messages) for p in self.prompts]
        if spec.queue > 1:
            self.engine.decode_slots = spec.slots  # the K x P prompts' episodes on the slots of one batch
        self.engine.generate(self.prompt_tokens[:spec.prompts], 1, max_new_tokens=2)  # warm-up: lazy init, kernels

    def info(self) -> dict[str, Any]:
        """What ran: engine, dtype, threads or BLAS, load time, prompt tokens."""
        out: dict[str, Any] = {"engine": self.name, "dtype": self.engine.dtype_name, "load_s": self.load_s,
                               "prompt_tokens_mean": statistics.mean(len(p) for p in self.prompt_tokens)}
        if self.name == "mlx":

            out["blas"] = blas_status()
        else:
            import torch

            out["threads"] = torch.get_num_threads()
        return out

    def episodes(self) -> dict[str, float]:
        """One seeded batch of P x N episodes (the same episodes every repeat)."""
        c0 = time.process_time()
        eb = sample_episodes(self.engine, self.task, self.codec, self.tools, self.prompts, self.spec.n,
                             max_turn_tokens=self.spec.turn_tokens, temperature=self.spec.temperature,
                             generator=self.engine.make_generator(self.spec.seed))
        return _episode_figures(eb) | {"cpu_s": time.process_time() - c0}

    def generate(self, eos: bool = True) -> dict[str, float]:
        """Single-turn ``generate`` on the same prompt tokens, P prompts a batch (K batches): N rows each, at most
        T new tokens.

        Args:
            eos: pass the codec's EOS ids as the worker does (keys ``generate_*``); False ignores EOS, every row
                decodes T tokens (keys ``generate_no_eos_*``, the ceiling column).
        """
        key = "generate" if eos else "generate_no_eos"
        c0, t0 = time.process_time(), time.perf_counter()
        gen, p = self.engine.make_generator(self.spec.seed), self.spec.prompts
        tokens = steps = 0
        prefill = 0.0
        for b in range(0, len(self.prompt_tokens), p):
            _, st = self.engine.generate(self.prompt_tokens[b:b + p], self.spec.n, max_new_tokens=self.spec.turn_tokens,
                                         temperature=self.spec.temperature, eos_ids=self.codec.eos_ids if eos else (),
                                         generator=gen)
            tokens, steps, prefill = tokens + st.new_tokens, steps + st.steps, prefill + st.prefill_s
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return {f"{key}_wall_s": wall, f"{key}_cpu_s": cpu, f"{key}_tokens": float(tokens),
                f"{key}_tokens_per_s": tokens / max(wall, 1e-9),
                f"{key}_tokens_per_cpu_s": tokens / max(cpu, 1e-9), f"{key}_prefill_s": prefill,
                f"{key}_steps": float(steps), f"{key}_rows_per_step": tokens / max(steps, 1)}

    def repeat(self) -> dict[str, float]:
        """One repeat: the episodes, then ``generate`` with EOS honoured, then with EOS ignored (:func:`with_ratio`)."""
        return with_ratio(self.episodes() | self.generate(eos=True) | self.generate(eos=False))


def with_ratio(fig: dict[str, float]) -> dict[str, float]:
    """One repeat's figures plus its side-by-side ratios, measured back to back so load changes hit both alike:
    ``episodes_vs_generate`` (episodes' action tokens/s over EOS-honoured ``generate`` tokens/s, the ratio),
    ``episodes_vs_generate_cpu`` (the same per CPU second), ``episodes_vs_generate_no_eos`` (over the
    EOS-ignored ceiling) and ``shape_vs_generate`` (episodes' rows per decode step over ``generate``'s: counted,
    so free of load; where a step costs about the same at any row count, as SmolLM2's on a CPU, the ratio
    follows it).

    Args:
        fig: the repeat's episode and generate figures.
    """
    action, cpu = fig["action_tokens_per_s"], fig["action_tokens"] / max(fig["cpu_s"], 1e-9)
    return fig | {"action_tokens_per_cpu_s": cpu,
                  "episodes_vs_generate": action / max(fig["generate_tokens_per_s"], 1e-9),
                  "episodes_vs_generate_cpu": cpu / max(fig["generate_tokens_per_cpu_s"], 1e-9),
                  "episodes_vs_generate_no_eos": action / max(fig["generate_no_eos_tokens_per_s"], 1e-9),
                  "shape_vs_generate": fig["rows_per_step"] / max(fig["generate_rows_per_step"], 1e-9)}


def ratio_line(rows: dict[str, dict[str, Any]]) -> str:
    """The benchmark's last line, ``ratio_episode_vs_single=X``: the lowest engine's median ratio of multi-turn
    action tokens/s to single-turn ``generate`` tokens/s (EOS honoured, as workers run it) on the same prompts
    and model.

    Args:
        rows: engine -> :func:`summarise`'s row.
    """
    return f"ratio_episode_vs_single={min(r['episodes_vs_generate'] for r in rows.values()):.3f}"


def summarise(info: dict[str, Any], runs: Sequence[dict[str, float]]) -> dict[str, Any]:
    """An engine's row: its info, the median of every figure over the repeats (``episodes_vs_generate``: the
    median of each repeat's side-by-side ratio), the action tokens/s range, and ``runs`` (every repeat's figures).

    Args:
        info: ``EngineRun.info()``.
        runs: one dict of figures per repeat (episodes and generate merged).
    """
    row: dict[str, Any] = dict(info) | {"repeats": len(runs)}
    for key in runs[0]:
        row[key] = statistics.median(r[key] for r in runs)
    row["action_tokens_per_s_min"] = min(r["action_tokens_per_s"] for r in runs)
    row["action_tokens_per_s_max"] = max(r["action_tokens_per_s"] for r in runs)
    row["runs"] = [dict(r) for r in runs]
    return row


def format_table(row: dict[str, Any], spec: EpisodeBenchSpec) -> str:
    """The table of one engine's medians.

    Args:
        row: :func:`summarise`'s row.
        spec: the settings.
    """
    runtime = f"BLAS {row['blas']}" if "blas" in row else f"torch threads {row.get('threads', '?')}"
    ends = ", ".join(f"{k.removeprefix('end/')} {v:.2f}" for k, v in row.items() if k.startswith("end/") and v)
    lines = [
        f"{row['engine']} ({row['dtype']}, {runtime}): {spec.task}, {spec.prompts} prompts x {spec.n} episodes"
        f"{f' x {spec.queue} queued on {spec.slots} slots' if spec.queue > 1 else ''}, "
        f"{spec.turn_tokens} tokens/turn, median of {row['repeats']}",
        f"  {'action tokens/s':<26}{row['action_tokens_per_s']:>10.1f}   "
        f"(min {row['action_tokens_per_s_min']:.1f}, max {row['action_tokens_per_s_max']:.1f}; "
        f"{row['action_tokens']:.0f} action tokens in {row['wall_s']:.2f}s)",
        f"  {'all tokens/s':<26}{row['all_tokens_per_s']:>10.1f}   "
        f"(+ {row['obs_tokens']:.0f} observation tokens)",
        f"  {'turns per episode':<26}{row['turns_mean']:>10.2f}   ({row['rounds']:.0f} tool rounds)",
        f"  {'rows per decode step':<26}{row['rows_per_step']:>10.2f}   ({row['steps']:.0f} steps; generate "
        f"{row['generate_rows_per_step']:.2f} in {row['generate_steps']:.0f}: {row['shape_vs_generate']:.2f}x; "
        f"EOS ignored {row['generate_no_eos_rows_per_step']:.2f}; {row['admitted']:.0f} rows admitted mid-flight)",
        f"  {'search rate':<26}{row['search_rate']:>10.2f}",
        f"  {'tool calls':<26}{row['tool_calls']:>10.0f}   ({row['tool_calls_mean']:.2f} per episode)",
        f"  {'tool seconds':<26}{row['tool_s']:>10.4f}   ({100 * row['tool_share']:.2f}% of wall)",
        f"  {'observation prefill s':<26}{row['obs_prefill_s']:>10.3f}   "
        f"({100 * row['obs_prefill_share']:.1f}% of wall)",
        f"  {'generate tokens/s':<26}{row['generate_tokens_per_s']:>10.1f}   "
        f"(single turn as workers run it, EOS honoured, {row['generate_tokens']:.0f} tokens; "
        f"episodes' actions at {row['episodes_vs_generate']:.2f}x, per CPU second "
        f"{row['episodes_vs_generate_cpu']:.2f}x)",
        f"  {'  EOS ignored (ceiling)':<26}{row['generate_no_eos_tokens_per_s']:>10.1f}   "
        f"(every row decodes T, {row['generate_no_eos_tokens']:.0f} tokens; episodes at "
        f"{row['episodes_vs_generate_no_eos']:.2f}x; not the ratio)",
        f"  {'end reasons':<26}{ends or '-':>10}   mean reward {row['reward_mean']:.3f}",
    ]
    return "\n".join(lines)


def run_episode_bench(spec: EpisodeBenchSpec, task: Any = None, echo: Callable[[str], Any] = print
                      ) -> dict[str, Any]:
    """Measure every engine of ``spec``; print one table per engine and return the figures.

    Args:
        spec: the settings.
        task: a task object to run instead of ``get_task(spec.task, **spec.options)`` (tests).
        echo: where the tables and progress lines go.

    Returns:
        ``{"spec": ..., "engines": {name: row}, "load_avg": ..., "time": ...}``; each row holds the medians
        of :func:`summarise`.
    """


    spec.check()
    if "mlx" in spec.engines:

        prepare_mlx_blas()  # before anything imports mlx
    model_dir = Path(resolve_model(spec.model))
    task = task if task is not None else get_task(spec.task, **_options(spec.options))
    tools = open_task_tools(task, role="bench", corpus="memory", note=echo).tools
    if tools is None:
        raise ValueError(f"task: {task.id!r} is single-turn; pick a multi-turn task (search, searchqa, walk)")
    rng = np.random.default_rng(spec.seed)
    prompts = [task.sample_train(rng) for _ in range(spec.prompts * spec.queue)]
    codec = TextCodec(model_dir)
    runs: list[EngineRun] = []
    for name in spec.engines:
        echo(f"[bench] starting {name} on {model_dir.name} ...")
        runs.append(EngineRun(name, model_dir, spec, task, tools, codec, prompts))
    figures: list[list[dict[str, float]]] = [[] for _ in runs]
    load: list[float] = []
    for rep in range(spec.repeats):
        for run, figs in zip(runs, figures, strict=True):
            figs.append(run.repeat())
            load.append(_load_avg())
            echo(f"[bench] repeat {rep + 1}/{spec.repeats} {run.name}: "
                 f"{figs[-1]['action_tokens_per_s']:.1f} action tokens/s, "
                 f"generate {figs[-1]['generate_tokens_per_s']:.1f} tokens/s "
                 f"(EOS ignored {figs[-1]['generate_no_eos_tokens_per_s']:.1f})")
    rows = {run.name: summarise(run.info(), figs) for run, figs in zip(runs, figures, strict=True)}
    for row in rows.values():
        echo(format_table(row, spec))
    return {"spec": asdict(spec), "model_dir": str(model_dir), "engines": rows,
            "load_avg": statistics.median(load), "time": time.time()}


def _options(items: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings as a dict (ValueError naming the bad item)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--option {item!r}: write KEY=VALUE, e.g. --option shots=0")
        out[key.strip()] = value.strip()
    return out


def _load_avg() -> float:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return float("nan")


def main(args: argparse.Namespace) -> int:
    """Run the benchmark with parsed flags.

    Args:
        args: parsed flags (see ``add_arguments``).
    """
    spec = EpisodeBenchSpec(model=args.model, engines=tuple(e for e in args.engines.split(",") if e),
                            task=args.task, options=tuple(args.option), prompts=args.prompts, n=args.n,
                            turn_tokens=args.turn_tokens, repeats=args.repeats, threads=args.threads,
                            dtype=args.dtype, temperature=args.temperature, seed=args.seed, queue=args.queue)
    result = run_episode_bench(spec, echo=lambda line: print(line, flush=True))
    print(f"[bench] load average {result['load_avg']:.2f} on {_cpus()} CPUs", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(f"[bench] wrote {args.json}", file=sys.stderr)
    for name, row in result["engines"].items():
        print(f"[bench] {name}: episodes' action tokens/s at {row['episodes_vs_generate']:.3f}x generate with EOS "
              f"honoured ({row['episodes_vs_generate_cpu']:.3f}x per CPU second; "
              f"{row['episodes_vs_generate_no_eos']:.3f}x the EOS-ignored ceiling; "
              f"median of {row['repeats']} side-by-side repeats; rows per decode step "
              f"{row['shape_vs_generate']:.3f}x generate's)", flush=True)
    print(ratio_line(result["engines"]), flush=True)
    return 0


def _cpus() -> int:
    return os.cpu_count() or 1
