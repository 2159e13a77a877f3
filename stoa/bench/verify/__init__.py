"""`stoa bench verify`: the per-worker sequential test's false-quarantine rate per engine pair and its
records-to-detect per attack.

Honest workers: every worker engine and dtype (``--engines``) holding each weight plane (``--planes``) built from
an off-grid float32 master (as after training), sampling ``--sequences`` completions each; the trainer's
``Policy`` recomputes them in float32 and under bf16 autocast (``--trainers``). Each record (a group of
``--n-samples``) gets the trainer's score (``stoa.trainer.sequential.record_score``), and the records are dealt in
order to simulated workers of ``--stream`` records each, every one running a fresh CUSUM with the trainer's
settings: a false quarantine is a stream whose CUSUM alarms. Attacks run on ``--liar-engine`` with ``--liar-plane``
against the fp32 recompute; each samples ``--attack-records`` records, and ``--attack-streams`` random orders of
them are fed to fresh CUSUMs: detected within the pool, and the median records it took. A mixed fleet
(``stoa.bench.verify.minority``): each pair's honest workers judged with the drift another pair's majority
calibrates (``--minority-records``). Lagged records
(``stoa.bench.verify.lagged``): honest workers and liars ``1..--max-lag`` versions behind, judged over the fleet's
level at their lag; the fleet's lag-0 records calibrate the drift (``--drift auto``, the trainer's default).
A LoRA run (``--lora-rank``, ``stoa.bench.verify.lora``): workers hold the base the contract names plus the adapter,
the trainer's LoRA policy recomputes on that base; its lies replace the attacks, and its lag-0 fleet (no versions
behind) calibrates the drift.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from stoa.bench.verify.intake import intake_rows
from stoa.bench.verify.intake import table as intake_table
from stoa.bench.verify.lagged import LagScores, fleet_of, lag_scores, load_arrays, save_arrays, shifted
from stoa.bench.verify.liars import attack_plan, copied_logprobs, noisy, quantized, swapped, top_k_sampler
from stoa.bench.verify.lora import LoraRig, contract_planes, lag0, lora_attacks, plane_label
from stoa.bench.verify.minority import minority_rows
from stoa.bench.verify.minority import table as minority_table
from stoa.bench.verify.sampling import Group, Rig
from stoa.bench.verify.stats import AttackRow, HonestRow, attack_row, honest_row, table
from stoa.bench.verify.steps import Residuals, flatten, step_row, unflatten, values
from stoa.bench.verify.steps import table as steps_table
from stoa.bench.verify.verdict import intake_verdict, logprob_verdict
from stoa.bench.verify.verdict import table as verdict_table
from stoa.config import TrainerConfig
from stoa.config.trainer import LORA_BASE_PLANES
from stoa.models import resolve_model
from stoa.trainer.fleet import calibrated_drift
from stoa.trainer.quarantine import effective_threshold, sequential_params
from stoa.trainer.sequential import CusumParams, record_score
from stoa.weights.planes import state_from_f32


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``stoa bench verify``.

    Args:
        p: the subcommand's parser.
    """

    d = TrainerConfig()
    p.add_argument("--model", default="tiny", help="model name or path [default: tiny]")
    p.add_argument("--engines", default="torch:float32,torch:bfloat16,mlx:float32,mlx:bfloat16",
                   help="comma list of engine:dtype honest workers [default: torch and mlx, fp32 and bf16]")
    p.add_argument("--planes", default="bf16,int8g64", help="comma list of weight planes [default: bf16,int8g64]")
    p.add_argument("--trainers", default="fp32,bf16", help="trainer recomputes: fp32, bf16 (autocast) [default: both]")
    p.add_argument("--sequences", type=int, default=100_000,
                   help="honest completions per engine and plane [default: 100000]")
    p.add_argument("--groups", type=int, default=64, help="groups (records) per sampling batch [default: 64]")
    p.add_argument("--n-samples", type=int, default=4, help="completions per group [default: 4]")
    p.add_argument("--max-new-tokens", type=int, default=32, help="max new tokens [default: 32]")
    p.add_argument("--temperature", type=float, default=1.0, help="the run's temperature [default: 1.0]")
    p.add_argument("--stream", type=int, default=1000, help="honest records per simulated worker [default: 1000]")
    p.add_argument("--attack-records", type=int, default=1024, help="records sampled per attack [default: 1024]")
    p.add_argument("--attack-streams", type=int, default=200, help="random orders run per attack [default: 200]")
    p.add_argument("--attacks", default="", help="comma list of attack numbers 1-12 to run ('' = all, 'none'; "
                                                  "the intake attacks: --intake)")
    p.add_argument("--liar-engine", default="torch:bfloat16", help="engine:dtype the attacks run on")
    p.add_argument("--liar-plane", default="bf16", help="weight plane the attacks run on [default: bf16]")
    p.add_argument("--drift", default="auto",
                   help=f"CUSUM reference per record, or auto: calibrated from the fleet's honest lag-0 records "
                        f"between quarantine_drift_floor = {d.quarantine_drift_floor} and quarantine_drift = "
                        f"{d.quarantine_drift}, as the trainer does [default: auto]")
    p.add_argument("--max-lag", type=int, default=2, help="lagged records at lags 1..this [default: 2]")
    p.add_argument("--lag-records", type=int, default=256,
                   help="honest records sampled per lag 0..--max-lag on --liar-engine (half set the fleet's level, "
                        "half are judged; the lags' lies are on them); 0: no lagged records [default: 256]")
    p.add_argument("--lag-lr", type=float, default=1e-4,
                   help="Adam learning rate of the steps between versions [default: 1e-4]")
    p.add_argument("--limit", type=float, default=d.quarantine_evidence,
                   help=f"CUSUM limit [default: quarantine_evidence = {d.quarantine_evidence}]")
    p.add_argument("--cap", type=float, default=d.quarantine_disagreement,
                   help=f"largest record score [default: quarantine_disagreement = {d.quarantine_disagreement}]")
    p.add_argument("--seed", type=int, default=0, help="master jitter, prompt and sampling seed [default: 0]")
    p.add_argument("--records-per-step", type=int, default=8,
                   help="the liar's lag-0 records per trainer step, for the per-step checks [default: 8]")
    p.add_argument("--intake", action=argparse.BooleanOptionalAction, default=True,
                   help="run the intake attacks (prompt swaps, replays, multi-turn forgeries) [default: on]")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="a LoRA run: workers hold the contract's base plus an adapter of this rank, the trainer's "
                        "LoRA policy recomputes (the LoRA lies replace the attacks; 0: full weights) [default: 0]")
    p.add_argument("--lora-alpha", type=float, default=d.lora_alpha,
                   help=f"LoRA alpha [default: lora_alpha = {d.lora_alpha:g}]")
    p.add_argument("--lora-base-plane", default="", choices=LORA_BASE_PLANES,
                   help="the trainer's lora_base_plane: int8g64 or int4g64 (the contract's plane; --planes ignored), "
                        "'' a float base on each of --planes [default: '']")
    p.add_argument("--lora-b-std", type=float, default=0.02,
                   help="the adapter's lora_B entries ~ N(0, this), fixed seed (0 moves nothing) [default: 0.02]")
    p.add_argument("--drift-factor", type=float, default=d.quarantine_drift_factor,
                   help="the calibrated drift over the fleet's lag-0 level (--drift auto and the mixed-fleet table) "
                        f"[default: quarantine_drift_factor = {d.quarantine_drift_factor:g}]")
    p.add_argument("--minority-records", type=int, default=1000,
                   help="a mixed fleet: each honest pair's workers judged with the drift another pair's majority "
                        "calibrates, streams of this many records drawn from its scores (0: no such table) "
                        "[default: 1000]")
    p.add_argument("--out", default="", help="append JSONL rows to this file")
    p.add_argument("--save-scores", default="", help="write every record score to this .npz")
    p.add_argument("--load-scores", default="",
                   help="judge the record scores of --save-scores files (comma list; a pair's scores from "
                        "several, e.g. other --seed, are joined) instead of sampling (with another --drift, --limit, "
                        "--stream)")


ROUNDING_RECORDS = 64
"""Records of each plane's first engine the trainer's rounding probe is measured on."""


def honest(rig: Rig, params: CusumParams, echo=print, planes: list[str] | None = None,
           rounding: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Every engine pair's honest record scores, by pair label (``planes``: those the rig holds; None: ``--planes``);
    ``rounding`` gets each plane's rounding probe scores (``Rig.rounding``) by plane label."""
    a, out = rig.args, {}
    batches = -(-a.sequences // (a.groups * a.n_samples))
    for plane in _split(a.planes) if planes is None else planes:
        state = rig.state(plane)
        for spec in _split(a.engines):
            engine, _, dtype = spec.partition(":")
            groups, secs = rig.sample(engine, dtype, state, plane, batches, a.temperature)
            if rounding is not None and rig.label(plane) not in rounding:
                rounding[rig.label(plane)] = rig.rounding(groups[:ROUNDING_RECORDS], params.cap)
            for trainer in _split(a.trainers):
                t0 = time.perf_counter()
                pair = f"{engine} {dtype} / {rig.label(plane)} / {trainer}"
                out[pair] = rig.scores(groups, trainer == "bf16", params.cap)
                echo(f"  {pair}: {len(groups) * a.n_samples} sequences sampled in {secs:.0f}s, scored in "
                     f"{time.perf_counter() - t0:.0f}s")
    return out


def attacks(rig: Rig, params: CusumParams, echo=print) -> tuple[dict[str, np.ndarray], dict[str, Residuals]]:
    """Every attack's record scores and residuals (``--liar-engine``, ``--liar-plane``, fp32 recompute), by label."""

    a, out, resid = rig.args, {}, {}
    engine, _, dtype = a.liar_engine.partition(":")
    batches = -(-a.attack_records // a.groups)
    wanted = {int(x) for x in _split(a.attacks)} if a.attacks not in ("", "none") else None
    plan = [] if a.attacks == "none" else attack_plan(a)
    for i, (label, how) in enumerate(plan, 1):
        if wanted is not None and i not in wanted:
            continue
        rng = np.random.default_rng(a.seed + 100 + i)
        master = rig.master
        if how.weights:
            master = noisy(rig.master, how.weights, rng)
        elif how.swap:
            master = swapped(rig.master, rng)
        elif how.bits:
            master = quantized(rig.master, how.bits)
        plane = how.plane or a.liar_plane
        with top_k_sampler(how.top_k):
            groups, secs = rig.sample(engine, dtype, state_from_f32(master, plane), plane, batches,
                                      a.temperature * how.temperature, how.top_p)
        groups = groups[:a.attack_records]
        if how.foreign:
            groups = rig.rescored(groups, swapped(rig.master, rng))
        if how.copied:
            groups = [Group(g.prompt, g.tokens, lps) for g, lps in zip(groups, copied_logprobs(groups, rng),
                                                                        strict=True)]
        resid[label] = list(rig.residuals(groups, False, how.lie, seed=a.seed + i))
        out[label] = np.array([record_score(values(np.concatenate(r)), params.cap)
                               for r in resid[label]])
        echo(f"  attack {label}: score mean {out[label].mean():.4f} ({secs:.0f}s)")
    return out, resid


def lora_run(args: argparse.Namespace, params: CusumParams, echo=print
             ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, Residuals], LagScores]:
    """A LoRA run (``--lora-rank``; ``stoa.bench.verify.lora``): honest scores per contract plane, and on the attack
    plane (``--lora-base-plane``, else ``--liar-plane``) the lag-0 fleet and the LoRA lies' scores and residuals."""
    hs: dict[str, np.ndarray] = {}
    ks: dict[str, np.ndarray] = {}
    rs: dict[str, Residuals] = {}
    ls = LagScores({}, {})
    for plane in contract_planes(args):
        rig = LoraRig(args, plane)
        if plane == (args.lora_base_plane or args.liar_plane):
            ls = lag0(rig, echo) if args.lag_records else ls
            ks, rs = lora_attacks(rig, params.cap, echo)
        hs.update(honest(rig, params, echo, [plane]))
    return hs, ks, rs, ls


def judge(honest_scores: dict[str, np.ndarray], attack_scores: dict[str, np.ndarray], params: CusumParams,
          args: argparse.Namespace) -> tuple[list[HonestRow], list[AttackRow]]:
    """The rows of the tables: honest streams of ``--stream`` records, ``--attack-streams`` orders per attack."""
    h = [honest_row(k, v, args.n_samples, args.stream, params) for k, v in honest_scores.items()]
    k = [attack_row(label, v, args.attack_streams, params, args.seed + i)
         for i, (label, v) in enumerate(attack_scores.items(), 1)]
    return h, k


def run_params(args: argparse.Namespace, ls: LagScores, rounding: dict[str, np.ndarray] | None = None) -> CusumParams:
    """The CUSUM judged with: ``--drift`` (scaled like the trainer's), or with ``auto`` the trainer's calibration
    over the fleet of the lagged run's honest lag-0 records (the ceiling without them) and the liar plane's rounding
    probes."""
    d = TrainerConfig()
    if args.drift != "auto":
        return sequential_params(float(args.drift), args.limit, args.cap, args.temperature)
    ceiling = sequential_params(d.quarantine_drift, args.limit, args.cap, args.temperature)
    fleet = fleet_of(ls)
    for x in (rounding or {}).get(args.liar_plane, ()):
        fleet.add_rounding(float(x))
    drift = calibrated_drift(fleet, effective_threshold(d.quarantine_drift_floor, args.temperature), ceiling.drift,
                             args.drift_factor)
    return CusumParams(drift=drift, limit=max(ceiling.limit, ceiling.cap - drift), cap=ceiling.cap)


def lag_rows(ls: LagScores, params: CusumParams, args: argparse.Namespace) -> tuple[list[HonestRow], list[AttackRow]]:
    """Honest rows per lag (the half of the records the fleet's level was not set on) and an attack row per lagged
    lie, every score on the lag-0 scale (``lagged.shifted``)."""
    if not ls.honest:
        return [], []
    plane = (plane_label(args.lora_base_plane or args.liar_plane, args.lora_rank) if getattr(args, "lora_rank", 0)
             else args.liar_plane)
    fleet, pair = fleet_of(ls), f"{args.liar_engine.replace(':', ' ')} / {plane} / fp32"
    h = [honest_row(f"{pair}, lag {lag}", shifted(fleet, lag, s[len(s) // 2:]), args.n_samples, args.stream, params)
         for lag, s in sorted(ls.honest.items())]
    k = [attack_row(f"{label} at lag {lag}", shifted(fleet, lag, s), args.attack_streams, params, args.seed + 50 + i)
         for i, ((lag, label), s) in enumerate(sorted(ls.attacks.items()))]
    return h, k


def main(args: argparse.Namespace) -> int:
    """Run the benchmark (or load its scores); print the tables; append JSONL rows to ``--out``.

    Args:
        args: parsed flags (see ``add_arguments``).
    """
    t0 = time.perf_counter()
    ceiling = sequential_params(TrainerConfig().quarantine_drift, args.limit, args.cap, args.temperature)
    if args.lora_base_plane and not args.lora_rank:
        raise SystemExit("--lora-base-plane needs a LoRA run: set --lora-rank > 0")
    if not 1.0 < args.drift_factor <= 10.0:
        raise SystemExit(f"--drift-factor must be in (1, 10] like quarantine_drift_factor, got {args.drift_factor:g}")
    if args.minority_records < 0:
        raise SystemExit(f"--minority-records must be >= 0 (0: no mixed-fleet table), got {args.minority_records}")
    rounding: dict[str, np.ndarray] = {}
    if args.load_scores:
        hs, ks, rs, ls, rounding = _load(args.load_scores)
    elif args.lora_rank:
        print(f"model {args.model}: LoRA r{args.lora_rank} alpha {args.lora_alpha:g} (lora_B ~ N(0, "
              f"{args.lora_b_std:g})) on a {args.lora_base_plane or 'float'} base")
        hs, ks, rs, ls = lora_run(args, ceiling)
    else:
        rig = Rig(args)
        print(f"model {rig.model_dir.name}: {args.groups} groups x {args.n_samples} samples a batch, <= "
              f"{args.max_new_tokens} tokens, T={args.temperature}")
        ls = lag_scores(rig) if args.lag_records else LagScores({}, {})
        hs, (ks, rs) = honest(rig, ceiling, rounding=rounding), attacks(rig, ceiling)
    if args.save_scores:
        _save(args.save_scores, hs, ks, rs, ls, rounding)
    params = run_params(args, ls, rounding)
    how = "" if args.drift != "auto" else " (calibrated)" if params.drift != ceiling.drift else " (the ceiling)"
    print(f"CUSUM drift {params.drift:.4g}{how}, limit "
          f"{params.limit:.4g}, cap {params.cap:.4g} (>= {params.min_records} records to quarantine); honest streams "
          f"of {args.stream} records")
    h, k = judge(hs, ks, params, args)
    lh, lk = lag_rows(ls, params, args)
    h, k = h + lh, k + lk
    cfg = replace(TrainerConfig(), quarantine_drift=math.expm1(math.log1p(params.drift) * args.temperature),
                  quarantine_drift_floor=0.0)  # the trainer's defaults once its fleet calibrated the drift
    s = [step_row(label, r, args.records_per_step, args.temperature, cfg) for label, r in rs.items()]
    i = intake_rows(Path(resolve_model(args.model))) if args.intake else []
    print()
    floor = effective_threshold(TrainerConfig().quarantine_drift_floor, args.temperature)
    m = minority_rows(hs, ceiling, floor, args.minority_records, args.attack_streams, args.seed, rounding,
                      args.drift_factor) if (
        args.minority_records > 0 and args.drift == "auto") else []
    parts = [table(h, k), minority_table(m), steps_table(s, args.records_per_step) if s else [],
             intake_table(i) if i else []]
    print("\n\n".join("\n".join(lines) for lines in parts if lines))
    by_label = {r.attack: r for r in s}
    verdicts = [logprob_verdict(r, by_label.get(r.attack), params) for r in k] + [intake_verdict(r) for r in i]
    print("\n" + "\n".join(verdict_table(verdicts)))
    worst = max((r.score_mean for r in h), default=0.0)
    print(f"\nhonest: {sum(r.quarantined for r in h)} false quarantines in {sum(r.sequences for r in h):,} "
          f"sequences; the noisiest pair's mean record score {worst:.4f} (drift {params.drift:.4g}); "
          f"({time.perf_counter() - t0:.0f}s)")
    if args.out:
        with Path(args.out).open("a") as f:
            for r in [*h, *k, *m, *s, *i, *verdicts]:
                f.write(json.dumps({"bench": "verify", "model": args.model, "kind": type(r).__name__,
                                    "drift": params.drift, "limit": params.limit, **r.__dict__}) + "\n")
    return 0


def _save(path: str, hs: dict[str, np.ndarray], ks: dict[str, np.ndarray], rs: dict[str, Residuals],
          ls: LagScores, rounding: dict[str, np.ndarray]) -> None:
    """Write the record scores, each attack's residuals (``steps.flatten``), the lagged scores and the rounding probes
    to ``path``."""
    arrays: dict[str, Any] = {**{f"honest:{k}": v for k, v in hs.items()}, **{f"attack:{k}": v for k, v in ks.items()},
                              **save_arrays(ls), **{f"round:{k}": v for k, v in rounding.items()}}
    for label, r in rs.items():
        arrays[f"resid:{label}"], arrays[f"rlens:{label}"], arrays[f"rsamp:{label}"] = flatten(r)
    np.savez(path, allow_pickle=False, **arrays)


def _load(paths: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, Residuals], LagScores,
                               dict[str, np.ndarray]]:
    """Honest and attack scores, attack residuals, lagged scores and rounding probes of ``--save-scores`` files (comma
    list); a label in several files (runs with other seeds) gets their scores one after the other."""
    found: dict[str, list[np.ndarray]] = {}
    for path in _split(paths):
        if not Path(path).is_file():
            raise SystemExit(f"--load-scores: {path} is not a file (write one with --save-scores)")
        try:
            with np.load(path, allow_pickle=False) as z:
                for k in z.files:
                    found.setdefault(k, []).append(z[k])
        except (OSError, ValueError, zipfile.BadZipFile) as e:
            raise SystemExit(f"--load-scores: {path} is not a --save-scores file ({type(e).__name__})") from None
    joined = {k: np.concatenate(v) for k, v in found.items()}
    resid = {k[6:]: unflatten(v, joined[f"rlens:{k[6:]}"], joined[f"rsamp:{k[6:]}"])
             for k, v in joined.items() if k.startswith("resid:")}
    return ({k[7:]: v for k, v in joined.items() if k.startswith("honest:")},
            {k[7:]: v for k, v in joined.items() if k.startswith("attack:")}, resid, load_arrays(joined),
            {k[6:]: v for k, v in joined.items() if k.startswith("round:")})


def _split(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]
