"""Lagged records for ``stoa bench verify``: honest workers and liars that sample ``k`` versions behind the trainer,
judged as the trainer judges them (``stoa.trainer.fleet``): each record's score over the fleet's honest level at its
lag, on the lag-0 scale.

The versions: the trainer holds the rig's master ``v``; version ``v - k`` is ``k`` optimizer steps behind, each the
first step of Adam at ``--lag-lr`` (every weight moves ``lr`` against the sign of its gradient) on a REINFORCE loss
of one batch of the older version's own samples with random rewards, as an RL step moves a policy. Honest workers
hold the plane of ``v - k``; the fleet's level at each lag is set by the first half of the honest records (dealt
into ``FLEET`` workers), the second half are the honest streams judged. The liars record the same samples with a
lie: logprobs + N(0, 0.1), or another init's logprobs. Imports torch only through the rig.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stoa.bench.verify.liars import logprob_noise, swapped
from stoa.bench.verify.sampling import Rig
from stoa.bench.verify.steps import values
from stoa.trainer.fleet import MIN_RECORDS, FleetLevels
from stoa.trainer.sequential import record_score
from stoa.weights.planes import state_from_f32

FLEET = 8
"""Honest workers the fleet's levels are computed over."""


@dataclass(frozen=True)
class LagScores:
    """Raw record scores (``record_score`` uncapped) of one run's lagged records.

    Args:
        honest: per lag (0..max), the honest records' scores in sampling order.
        attacks: per ``(lag, label)``, the liar's records' scores.
    """

    honest: dict[int, np.ndarray]
    attacks: dict[tuple[int, str], np.ndarray]


def older_masters(rig: Rig, lags: int, lr: float, seed: int) -> list[dict[str, np.ndarray]]:
    """``[v, v - 1, ..., v - lags]``: each an Adam first step (``lr`` x sign of the gradient) behind the next."""
    import torch

    from stoa.engines.torch_scoring import pack_tensors

    out = [rig.master]
    params = dict(rig.policy.model.named_parameters())
    rng = np.random.default_rng(seed)
    try:
        for _ in range(lags):
            groups, _ = rig.sample("torch", "float32", state_from_f32(out[-1], "bf16"), "bf16", 1,
                                   rig.args.temperature)
            rig.policy.load_f32(out[-1])
            for p in params.values():
                p.requires_grad_(True)
                p.grad = None
            prompts = [np.asarray(g.prompt) for g in groups for _ in g.tokens]
            comps = [c for g in groups for c in g.tokens]
            adv = torch.tensor(rng.choice([-1.0, 1.0], size=len(comps)), dtype=torch.float32)
            lp = rig.policy.logprobs(pack_tensors(prompts, comps, max(len(c) for c in comps), rig.policy.device))
            (-(adv[:, None] * lp).sum() / len(comps)).backward()
            step = {n: (lr * torch.sign(p.grad)).numpy() if p.grad is not None else 0.0 for n, p in params.items()}
            out.append({n: (v - step.get(n, 0.0)).astype(np.float32) for n, v in out[-1].items()})
    finally:
        for p in params.values():
            p.requires_grad_(False)
            p.grad = None
        rig.policy.load_f32(rig.master)
    return out


def lag_scores(rig: Rig, echo=print) -> LagScores:
    """Sample ``--lag-records`` honest records at each lag 0..``--max-lag`` on ``--liar-engine`` and
    ``--liar-plane``; score them, and the lies on them at lags >= 1, against the trainer's fp32 recompute at ``v``."""
    a = rig.args
    if a.lag_records < MIN_LAG_RECORDS:
        raise SystemExit(f"--lag-records must be 0 or >= {MIN_LAG_RECORDS} (half set the levels of {FLEET} fleet "
                         f"workers, {MIN_RECORDS} records each), got {a.lag_records}")
    engine, _, dtype = a.liar_engine.partition(":")
    masters = older_masters(rig, a.max_lag, a.lag_lr, a.seed + 7)
    batches = -(-a.lag_records // a.groups)
    honest, attacks = {}, {}
    for k, master in enumerate(masters):
        groups, secs = rig.sample(engine, dtype, state_from_f32(master, a.liar_plane), a.liar_plane, batches,
                                  a.temperature)
        groups = groups[:a.lag_records]
        honest[k] = _scores(rig.residuals(groups, False))
        echo(f"  lag {k}: honest score median {np.median(honest[k]):.4f} ({secs:.0f}s)")
        if k == 0:
            continue
        rng = np.random.default_rng(a.seed + 200 + k)
        attacks[k, "logprobs + N(0, 0.1)"] = _scores(rig.residuals(groups, False, logprob_noise(0.1), seed=k))
        foreign = rig.rescored(groups, swapped(rig.master, rng))
        attacks[k, "logprobs of another model"] = _scores(rig.residuals(foreign, False))
        for label in ("logprobs + N(0, 0.1)", "logprobs of another model"):
            echo(f"  lag {k} attack {label}: score median {np.median(attacks[k, label]):.4f}")
    return LagScores(honest, attacks)


def _scores(residuals) -> np.ndarray:
    return np.array([record_score(values(np.concatenate(r)), np.inf) for r in residuals])


def fleet_of(scores: LagScores) -> FleetLevels:
    """The fleet's levels: the first half of each lag's honest records dealt round-robin into ``FLEET`` workers."""
    fleet = FleetLevels(max(scores.honest, default=0))
    for k, s in scores.honest.items():
        for i, x in enumerate(s[:len(s) // 2]):
            fleet.add(f"fleet{i % FLEET}", k, float(x))
    return fleet


def shifted(fleet: FleetLevels, lag: int, scores: np.ndarray) -> np.ndarray:
    """``scores`` of a worker outside the fleet on the lag-0 scale (``FleetLevels.shifted``; none without levels)."""
    out = [fleet.shifted("judged", lag, float(x)) for x in scores]
    return np.array([x for x in out if x is not None], np.float64)


MIN_LAG_RECORDS = 2 * FLEET * MIN_RECORDS
"""Fewest ``--lag-records``: half of them give each fleet worker ``MIN_RECORDS``."""


def save_arrays(scores: LagScores) -> dict[str, np.ndarray]:
    """The ``--save-scores`` arrays: ``lagh:<k>`` and ``laga:<k>:<label>``."""
    out = {f"lagh:{k}": v for k, v in scores.honest.items()}
    out.update({f"laga:{k}:{label}": v for (k, label), v in scores.attacks.items()})
    return out


def load_arrays(joined: dict[str, np.ndarray]) -> LagScores:
    """``save_arrays``' inverse (over the joined arrays of the loaded files)."""
    honest = {int(k[5:]): v for k, v in joined.items() if k.startswith("lagh:")}
    attacks = {}
    for key, v in joined.items():
        if key.startswith("laga:"):
            lag, _, label = key[5:].partition(":")
            attacks[int(lag), label] = v
    return LagScores(honest, attacks)
