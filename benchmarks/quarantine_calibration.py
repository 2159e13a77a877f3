"""`stoa bench quarantine`: calibrate the lag-0 disagreement threshold on honest workers, then catch liars.

At lag 0 the trainer recomputes a record's logprobs with its float32 master weights, while the worker
sampled with the published plane of those weights (bf16: the master rounded; int8g64: quantised) in
its own engine and compute dtype. This benchmark reproduces exactly that: the trainer's ``Policy``
with a master moved off the bf16 grid (as after training: every weight a uniform fraction of a bf16
ulp away from the plane value, unless ``--on-grid``), the plane built from it with ``state_from_f32``
and loaded into each worker engine the way a worker loads it. Each engine and dtype samples
``--batches`` batches of groups; each batch stands for one worker's lag-0 records in one trainer step.
Per token it computes grail's statistic ``exp|recorded - recomputed| - 1``; per batch its median.
Recomputes run twice: float32 (the CPU trainer) and under bf16 autocast (what the trainer does on CUDA).
Dishonest workers (another temperature, perturbed weights, noisy or random logprobs) run on
``--liar-engine``. Each row ends with the verdict of a ``Quarantine`` fed the batches as steps. Per sample it
also takes the median over the sample's tokens, which the step's recompute check judges
(``stoa.trainer.recompute_check``): the summary gives the honest maximum and how many samples are over the
check's limit.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stoa.bench.verify.sampling import offgrid
from stoa.config.text import deprecated_flag

LIARS = ("temperature", "perturbed", "noise", "random")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``stoa bench quarantine``.

    Args:
        p: the subcommand's parser.
    """
    from stoa.config import TrainerConfig

    d = TrainerConfig()
    p.add_argument("--model", default="tiny", help="model name or path [default: tiny]")
    p.add_argument("--engines", default="torch,mlx", help="comma list of torch,mlx [default: both]")
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma list of engine dtypes [default: both]")
    p.add_argument("--planes", default="bf16", help="comma list of bf16,int8g64 [default: bf16]")
    p.add_argument("--batches", type=int, default=4,
                   help="batches (trainer steps) per engine/dtype [default: 4]")
    p.add_argument("--groups", type=int, default=4, help="groups per batch [default: 4]")
    p.add_argument("--n-samples", dest="samples", metavar="N",
                   type=int, default=4, help="completions per group [default: 4]")
    deprecated_flag(p, "--samples", "--n-samples")
    p.add_argument("--max-new-tokens", dest="tokens", metavar="N",
                   type=int, default=32, help="max new tokens [default: 32]")
    deprecated_flag(p, "--tokens", "--max-new-tokens")
    p.add_argument("--temperature", type=float, default=d.temperature,
                   help=f"the run's temperature [default: {d.temperature}]")
    p.add_argument("--top-p", type=float, default=d.top_p, help="the run's nucleus mass [default: 1.0]")
    p.add_argument("--threshold", type=float, default=d.quarantine_disagreement,
                   help=f"disagreement threshold to judge against [default: {d.quarantine_disagreement}]")
    p.add_argument("--min-records", type=int, default=d.quarantine_min_records,
                   help=f"lag-0 records before judging [default: {d.quarantine_min_records}]")
    p.add_argument("--liars", default=",".join(LIARS), help=f"comma list of {','.join(LIARS)} ('' for none)")
    p.add_argument("--liar-engine", default="torch:bfloat16", help="engine:dtype the liars run on")
    p.add_argument("--liar-temperature", type=float, default=0.7,
                   help="the temperature liar samples at this times the run's [default: 0.7]")
    p.add_argument("--liar-noise", type=float, default=0.3,
                   help="the noise liar adds N(0, this) to its logprobs [default: 0.3]")
    p.add_argument("--liar-perturb", type=float, default=0.05,
                   help="the perturbed liar samples with weights + N(0, this x each tensor's std) "
                        "[default: 0.05]")
    p.add_argument("--on-grid", action="store_true",
                   help="keep the master on the bf16 grid (plane == master)")
    p.add_argument("--seed", type=int, default=0, help="prompt, jitter and sampling seed [default: 0]")
    p.add_argument("--out", default="", help="append JSONL rows to this file")


@dataclass
class Row:
    """One engine/dtype/plane (or liar) setting against one trainer recompute."""

    setting: str
    trainer: str  # fp32 or bf16-autocast
    tokens: int
    batch_medians: list[float]
    p90: float  # token-level 90th percentile
    quarantined: bool
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Batch:
    """One batch of sampled groups: prompts, completions' tokens and recorded logprobs."""

    prompts: list[list[int]]
    tokens: list[list[np.ndarray]]
    logprobs: list[list[np.ndarray]]


def build_worker(engine: str, dtype: str, model_dir: Path, state: dict[str, np.ndarray], plane: str) -> Any:
    """A worker engine holding a published state, built and loaded the way a fleet worker does.

    Args:
        engine: ``torch`` or ``mlx``.
        dtype: engine compute dtype.
        model_dir: model directory.
        state: the published plane state (stored bits).
        plane: its plane.
    """
    from stoa.engines import make_engine

    eng = make_engine(engine, model_dir, dtype=dtype, device="cpu", plane=plane)
    eng.load_state(state, plane)
    return eng


def sample(eng: Any, prompts: list[list[int]], args: argparse.Namespace, eos: list[int], seed: int,
           temperature: float) -> Batch:
    """Sample one batch of groups with a worker engine.

    Args:
        eng: the engine.
        prompts: prompt token ids.
        args: flags (samples, tokens, top_p).
        eos: end-of-sequence ids.
        seed: sampling seed.
        temperature: sampling temperature.
    """
    groups, _ = eng.generate(prompts, args.samples, max_new_tokens=args.tokens, temperature=temperature,
                             top_p=args.top_p, eos_ids=eos, generator=eng.make_generator(seed))
    return Batch(prompts, [[np.asarray(c.tokens, np.int32) for c in g] for g in groups],
                 [[np.asarray(c.logprobs, np.float32) for c in g] for g in groups])


def recompute(policy: Any, batch: Batch) -> list[list[np.ndarray]]:
    """The trainer's logprobs of a batch's tokens (``Policy.logprobs`` on packed groups, as ``train_step``).

    Args:
        policy: the trainer's ``Policy``.
        batch: sampled groups.
    """
    import torch

    from stoa.engines.torch_scoring import pack_tensors

    out = []
    for prompt, comps in zip(batch.prompts, batch.tokens, strict=True):
        t_max = max(len(c) for c in comps)
        with torch.no_grad():
            packed = pack_tensors([np.asarray(prompt)] * len(comps), comps, t_max, policy.device)
            lp = policy.logprobs(packed).cpu().numpy()
        out.append([lp[i, : len(c)] for i, c in enumerate(comps)])
    return out


def judge(setting: str, trainer: str, values: list[np.ndarray], args: argparse.Namespace,
          seconds: float) -> Row:
    """Summarise one setting's per-batch values and run them through a ``Quarantine`` as trainer steps.

    Args:
        setting: label.
        trainer: recompute label.
        values: per batch, the tokens' ``exp|recorded - recomputed| - 1``.
        args: flags (threshold, min_records, top_p, groups).
        seconds: time spent sampling.
    """
    from stoa.trainer.quarantine import Disagreement, Quarantine

    q = Quarantine(enabled=True, disagreement=args.threshold, reject_rate=0.5, min_records=args.min_records,
                   temperature=args.temperature, top_p=args.top_p)
    for v in values:
        q.observe_disagreement("w", Disagreement(v, args.groups))
    allv = np.concatenate(values)
    return Row(setting, trainer, int(allv.size), [float(np.median(v)) for v in values],
               float(np.quantile(allv, 0.9)), q.is_quarantined("w"), seconds)


def _sample_medians(recorded: list[list[np.ndarray]], recomputed: list[list[np.ndarray]]) -> list[float]:
    """Each sample's median ``exp|recorded - recomputed| - 1`` over its tokens (what the recompute check judges)."""
    from stoa.trainer.quarantine import disagreement_values

    return [float(np.median(disagreement_values(r, c))) for rg, cg in zip(recorded, recomputed, strict=True)
            for r, c in zip(rg, cg, strict=True) if len(r)]


def _values(recorded: list[list[np.ndarray]], recomputed: list[list[np.ndarray]]) -> np.ndarray:
    from stoa.trainer.quarantine import disagreement_values

    return np.concatenate([disagreement_values(r, c) for rg, cg in zip(recorded, recomputed, strict=True)
                           for r, c in zip(rg, cg, strict=True)])


class Bench:
    """Shared state of one run: the trainer's policy, master weights, prompts per batch.

    Args:
        args: parsed flags.
    """

    def __init__(self, args: argparse.Namespace):
        import torch

        from stoa.models import resolve_model
        from stoa.tasks import get_task
        from stoa.tokenize import TextCodec
        from stoa.trainer.policy import Policy

        self.args = args
        self.model_dir = Path(resolve_model(args.model))
        self.policy = Policy(self.model_dir, torch.device("cpu"), temperature=args.temperature,
                             trainable=False)
        rng = np.random.default_rng(args.seed)
        master = self.policy.export_f32()
        self.master = {k: v.copy() for k, v in master.items()} if args.on_grid else offgrid(master, rng)
        self.policy.load_f32(self.master)
        codec = TextCodec(self.model_dir)
        task = get_task("arithmetic")
        self.eos = list(codec.eos_ids)
        rngs = [[np.random.default_rng(args.seed + 1000 * b + g) for g in range(args.groups)]
                for b in range(args.batches)]
        self.prompts = [[codec.encode_prompt(task.sample_train(r).messages) for r in rs] for rs in rngs]

    def rows(self, setting: str, batches: list[Batch], seconds: float,
             lie: Callable[[Batch], list[list[np.ndarray]]] | None = None) -> list[Row]:
        """Judge a setting's batches against both trainer recomputes.

        Args:
            setting: label.
            batches: what the worker sampled.
            seconds: sampling time.
            lie: replaces the recorded logprobs of a batch (None: as sampled).
        """
        from stoa.trainer.quarantine import effective_threshold
        from stoa.trainer.recompute_check import RECOMPUTE_LIMIT

        limit = effective_threshold(RECOMPUTE_LIMIT, self.args.temperature, self.args.top_p)
        recorded = [lie(b) if lie else b.logprobs for b in batches]
        out = []
        for trainer, autocast in (("fp32", False), ("bf16-autocast", True)):
            self.policy.autocast = autocast
            vals, meds = [], []
            for r, b in zip(recorded, batches, strict=True):
                rc = recompute(self.policy, b)
                vals.append(_values(r, rc))
                meds += _sample_medians(r, rc)
            row = judge(setting, trainer, vals, self.args, seconds)
            row.extra = {"samples": len(meds), "sample_median_max": max(meds, default=0.0),
                         "sample_median_min": min(meds, default=0.0),
                         "samples_over_limit": sum(m > limit for m in meds)}
            out.append(row)
        self.policy.autocast = False
        return out

    def run_engine(self, engine: str, dtype: str, state: dict[str, np.ndarray], plane: str,
                   temperature: float | None = None) -> tuple[list[Batch], float]:
        """Sample every batch with one engine holding ``state``; return the batches and the seconds taken.

        Args:
            engine: ``torch`` or ``mlx``.
            dtype: its compute dtype.
            state: the published state it loads.
            plane: the state's plane.
            temperature: sampling temperature (default: the run's).
        """
        t0 = time.perf_counter()
        eng = build_worker(engine, dtype, self.model_dir, state, plane)
        temp = self.args.temperature if temperature is None else temperature
        batches = [sample(eng, p, self.args, self.eos, self.args.seed + b, temp)
                   for b, p in enumerate(self.prompts)]
        return batches, time.perf_counter() - t0


def honest_rows(bench: Bench, echo: Callable[[str], Any]) -> list[Row]:
    """Every plane x engine x dtype, honest.

    Args:
        bench: the shared state.
        echo: progress lines.
    """
    from stoa.weights.planes import state_from_f32

    a, rows = bench.args, []
    for plane in _split(a.planes):
        state = state_from_f32(bench.master, plane)
        for engine in _split(a.engines):
            for dtype in _split(a.dtypes):
                batches, secs = bench.run_engine(engine, dtype, state, plane)
                rows += bench.rows(f"{engine} {dtype} {plane}", batches, secs)
                echo(f"  sampled {engine} {dtype} ({plane} plane) in {secs:.1f}s")
    return rows


def liar_rows(bench: Bench, echo: Callable[[str], Any]) -> list[Row]:
    """Dishonest workers on ``--liar-engine`` with the bf16 plane.

    Args:
        bench: the shared state.
        echo: progress lines.
    """
    from stoa.weights.planes import state_from_f32

    a, rows = bench.args, []
    engine, _, dtype = a.liar_engine.partition(":")
    state = state_from_f32(bench.master, "bf16")
    rng = np.random.default_rng(a.seed + 7)
    honest: list[Batch] | None = None
    for liar in _split(a.liars):
        if liar == "temperature":
            temp = a.temperature * a.liar_temperature
            batches, secs = bench.run_engine(engine, dtype, state, "bf16", temperature=temp)
            rows += bench.rows(f"liar: samples at T x{a.liar_temperature} ({engine} {dtype})", batches, secs)
        elif liar == "perturbed":
            noisy = {k: v + rng.normal(0, a.liar_perturb * float(v.std()), v.shape).astype(np.float32)
                     for k, v in bench.master.items()}
            batches, secs = bench.run_engine(engine, dtype, state_from_f32(noisy, "bf16"), "bf16")
            label = f"liar: weights + {a.liar_perturb:.0%} noise ({engine} {dtype})"
            rows += bench.rows(label, batches, secs)
        elif liar in ("noise", "random"):
            if honest is None:
                honest, _ = bench.run_engine(engine, dtype, state, "bf16")
            if liar == "noise":
                lie = lambda b: [[np.minimum(x + rng.normal(0, a.liar_noise, x.shape), 0)  # noqa: E731
                                  for x in g] for g in b.logprobs]
                label = f"liar: logprobs + N(0, {a.liar_noise}) ({engine} {dtype})"
                rows += bench.rows(label, honest, 0.0, lie)
            else:
                lie = lambda b: [[rng.uniform(-5, 0, x.shape) for x in g] for g in b.logprobs]  # noqa: E731
                rows += bench.rows(f"liar: logprobs ~ U(-5, 0) ({engine} {dtype})", honest, 0.0, lie)
        else:
            raise ValueError(f"liar {liar!r}: use {', '.join(LIARS)}")
        echo(f"  liar {liar} done")
    return rows


def report(rows: list[Row], args: argparse.Namespace, echo: Callable[[str], Any]) -> dict[str, Any]:
    """Print the table and the verdict; return the summary.

    Args:
        rows: every setting against both trainer recomputes.
        args: flags.
        echo: where lines go.
    """
    from stoa.trainer.quarantine import effective_threshold
    from stoa.trainer.recompute_check import RECOMPUTE_LIMIT

    thr = effective_threshold(args.threshold, args.temperature, args.top_p)
    echo(f"\n{'setting':44} {'trainer':13} {'tokens':>6} {'batch median min/med/max':>28} {'max/thr':>7} "
         f"{'tok p90':>8} quarantined")
    for r in rows:
        bm = r.batch_medians
        echo(f"{r.setting:44} {r.trainer:13} {r.tokens:6d} {min(bm):9.5f} {float(np.median(bm)):8.5f} "
             f"{max(bm):9.5f} {max(bm) / thr:7.3f} {r.p90:8.4f} {'YES' if r.quarantined else 'no'}")
    honest = [r for r in rows if not r.setting.startswith("liar")]
    liars = [r for r in rows if r.setting.startswith("liar")]
    worst = max((max(r.batch_medians) for r in honest), default=0.0)
    least = min((min(r.batch_medians) for r in liars), default=float("nan"))
    summary = {"threshold": thr, "honest_max_batch_median": worst,
               "margin": thr / worst if worst else float("inf"),
               "false_positives": sum(r.quarantined for r in honest), "honest_settings": len(honest),
               "liars_caught": sum(r.quarantined for r in liars), "liar_settings": len(liars),
               "liar_min_batch_median": least}
    limit = effective_threshold(RECOMPUTE_LIMIT, args.temperature, args.top_p)
    summary.update({"recompute_limit": limit,
                    "honest_sample_median_max": max((r.extra["sample_median_max"] for r in honest), default=0.0),
                    "honest_samples_over_limit": sum(r.extra["samples_over_limit"] for r in honest),
                    "honest_samples": sum(r.extra["samples"] for r in honest),
                    "liar_samples_over_limit": sum(r.extra["samples_over_limit"] for r in liars),
                    "liar_samples": sum(r.extra["samples"] for r in liars)})
    echo(f"\nthreshold {thr:.4g} ({args.threshold} at T={args.temperature}, top_p={args.top_p}): honest max "
         f"batch median {worst:.5f} (margin {summary['margin']:.1f}x), false positives "
         f"{summary['false_positives']} of {len(honest)}; liars caught {summary['liars_caught']} of "
         f"{len(liars)} "
         f"(least liar batch median {least:.4f})")
    echo(f"per sample (the step's recompute check, limit {limit:.4g}): honest max median "
         f"{summary['honest_sample_median_max']:.5f}, {summary['honest_samples_over_limit']} of "
         f"{summary['honest_samples']} honest samples over the limit; {summary['liar_samples_over_limit']} of "
         f"{summary['liar_samples']} liar samples over it")
    return summary


def main(args: argparse.Namespace) -> int:
    """Run the calibration; print the table; append JSONL rows to ``--out``.

    Args:
        args: parsed flags (see ``add_arguments``).
    """
    import logging

    import torch

    logging.getLogger("stoa.trainer.quarantine").setLevel(logging.ERROR)  # the table says who is quarantined
    t0 = time.perf_counter()
    bench = Bench(args)
    print(f"model {bench.model_dir.name}: {args.batches} batches x {args.groups} groups x {args.samples} "
          "samples, "
          f"<= {args.tokens} tokens, T={args.temperature}, top_p={args.top_p}, master "
          f"{'on' if args.on_grid else 'off'} the bf16 grid, torch threads {torch.get_num_threads()}")
    rows = honest_rows(bench, print) + liar_rows(bench, print)
    summary = report(rows, args, print)
    print(f"({time.perf_counter() - t0:.0f}s)")
    if args.out:
        with Path(args.out).open("a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "quarantine", "model": args.model, **r.__dict__}) + "\n")
            f.write(json.dumps({"bench": "quarantine", "model": args.model, "summary": summary}) + "\n")
    return 0


def _split(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


if __name__ == "__main__":
    import sys

    _p = argparse.ArgumentParser(prog="python benchmarks/quarantine_calibration.py", description=__doc__)
    add_arguments(_p)
    sys.exit(main(_p.parse_args()))
