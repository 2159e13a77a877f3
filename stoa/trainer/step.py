"""One optimizer step over a batch of groups, for any algorithm behind the Algorithm protocol.

Multi-turn groups (entries the pool replayed) become episodes with token roles: the forward scores every action
and echo token, the algorithm's ratio, clip, gate and KL read the action tokens only (``LossInputs.mask``), GiGPO's
per-token advantages come from the trainer's own replay (turns and anchor states, never the worker's claims),
and the ECHO term reads the echo tokens with this step's coefficient.

Every lag-0 sample is judged on the logprobs the forward computes anyway (``stoa.trainer.recompute_check``): a group
with a sample whose recorded logprobs are far from the trainer's contributes no loss (its rows are masked; rows
of it already accumulated in an earlier micro-batch are subtracted again) and is counted in ``StepMetrics.rejected``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from stoa.algorithms import Algorithm, combine_metrics
from stoa.algorithms.batch import Batch, Trajectory, build_batch, group_indices, micro_batches, pack
from stoa.algorithms.inputs import EchoStep, echo_step
from stoa.algorithms.torch_accumulate import MicroForward, accumulate
from stoa.algorithms.torch_loss import clip_and_step
from stoa.engines.torch_scoring import Scores, to_device
from stoa.episodes.collect import episode_metrics
from stoa.layout import rollout_worker
from stoa.trainer.dist import SINGLE, Dist, split_groups
from stoa.trainer.policy import Policy, Reference
from stoa.trainer.pool import Entry, PoolStats
from stoa.trainer.quarantine import Disagreement, disagreement_values
from stoa.trainer.recompute_check import RecomputeCheck
from stoa.trainer.rounding import finite, rounding_probe


class GroupCheck(NamedTuple):
    """A lag-0 group's recompute verdict in one step (groups with lag > 0 are not judged)."""

    residual: float
    """Its largest sample median ``exp|recorded - recomputed| - 1`` over action tokens."""
    rejected: bool
    """Whether the recompute check dropped it (over the limit)."""


class StepMetrics(dict):
    """``train_step``'s flat float metrics (a plain ``dict[str, float]`` to its callers), plus
    ``disagreement``: per worker id, its lag-0 tokens' ``exp|recorded - recomputed| - 1``
    (see ``stoa.trainer.quarantine``), measured on the logprobs the step computes anyway; and ``rejected``:
    per reason (``recompute``), the groups the step did not train on (``rollout/rejected/<reason>``);
    ``groups``: per entry index, its recompute verdict (``stoa.trainer.provenance``); and ``rounding``: the step's
    rounding probe, when asked (``stoa.trainer.rounding``)."""

    def __init__(self, metrics: dict[str, float], disagreement: dict[str, Disagreement],
                 rejected: dict[str, int] | None = None, groups: dict[int, GroupCheck] | None = None,
                 rounding: list[float] | None = None):
        super().__init__(metrics)
        self.disagreement = disagreement
        self.rejected = rejected or {}
        self.groups = groups or {}
        self.rounding = rounding or []


def entry_worker(e: Entry) -> str:
    """The worker id an entry is charged to: its key's worker, else (a key that is not a record
    key, as in tests and benchmarks) the record's ``worker_id``.

    Args:
        e: a pool entry.
    """
    return rollout_worker(e.key) or e.record.worker_id


def entries_batch(entries: Sequence[Entry], algo: Algorithm, current_version: int) -> Batch:
    """The step's batch: one group per entry with the pool's rewards, each record's version lag and worker,
    and the workers' recorded logprobs as the old policy of the ratio.

    Entries the pool replayed (multi-turn) become episodes (``Trajectory.multi_turn``): roles from the record,
    turns and anchor states from the trainer's replay. Others are single-turn completions.

    Args:
        entries: the groups of this step (through the algorithm's group filter at intake).
        algo: the algorithm.
        current_version: the policy version being trained.
    """
    lags = [current_version - e.record.policy_version for e in entries]
    batch = build_batch([entry_trajectories(e) for e in entries], algo, version_lag=lags,
                        sources=[entry_worker(e) for e in entries])
    batch.old_logp = batch.rollout_logp
    return batch


def entry_trajectories(e: Entry) -> list[Trajectory]:
    """An entry's group: its samples with the pool's rewards, as episodes when the pool replayed them.

    Args:
        e: a pool entry (``e.replayed``: one ``Replayed`` per sample, or None for a single-turn task).

    Raises:
        ValueError: a replay count that is not one per sample.
    """
    rec = e.record
    if e.replayed is None:
        return [Trajectory.single_turn(rec.prompt_tokens, s.tokens, s.logprobs, float(r), s.finish_reason)
                for s, r in zip(rec.samples, e.rewards, strict=True)]
    if len(e.replayed) != len(rec.samples):
        raise ValueError(f"replayed: {len(e.replayed)} replays for {len(rec.samples)} samples of {e.key!r}")
    return [Trajectory.multi_turn(rec.prompt_tokens, s.tokens, s.role_array(), s.logprobs, float(r), s.finish_reason,
                                  rep.turn_of_token, rep.states)
            for s, r, rep in zip(rec.samples, e.rewards, e.replayed, strict=True)]


def step_echo(batch: Batch, algo: Algorithm, step: int, total_steps: int) -> EchoStep:
    """The echo settings of a step: the algorithm's coefficient at ``step`` when the batch has echo tokens
    (``stoa.algorithms.inputs.echo_step``; a batch without any asks for no coefficient).

    Args:
        batch: the step's batch.
        algo: the algorithm (``echo_coefficient``).
        step: the optimizer step about to be taken (0 for the first).
        total_steps: the run's total steps (the 'linear_taper_to_zero' schedule needs them).
    """
    alpha = algo.echo_coefficient(step, total_steps) if batch.echo_mask.any() else None
    return echo_step(batch, algo, alpha)


def train_step(
    policy: Policy,
    ref: Reference | None,
    opt: torch.optim.Optimizer,
    algo: Algorithm,
    entries: Sequence[Entry],
    *,
    current_version: int,
    micro_batch: int,
    grad_clip: float,
    shared_prefix: bool = True,
    step: int = 0,
    total_steps: int = 0,
    dist: Dist = SINGLE,
    top_p: float = 1.0,
    recompute_limit: float | None = None,
    probe: bool = False,
) -> StepMetrics:
    """Compute advantages, accumulate the loss over micro-batches, clip, and step the optimizer.

    The loss normaliser comes from the whole batch, so the sum over micro-batches equals the
    whole-batch loss exactly (tested). With several ranks every rank builds the same batch, runs its share of the
    groups (``rank_micro_batches``) and the sharded gradients are summed, so the step equals the single-process
    one; the metrics are gathered on rank 0.

    Args:
        policy: the trainable policy.
        ref: frozen reference policy (a LoRA policy's: its ``BaseView``), or ``None`` when the KL coefficient is 0.
        opt: the optimizer.
        algo: the algorithm (torch backend).
        entries: the groups of this step.
        current_version: the policy version being trained (lag 0 means sampled with these weights).
        micro_batch: sequences per forward/backward (packed mode).
        grad_clip: max global gradient norm (0 disables).
        shared_prefix: run each group's prompt once and its completions on the shared KV cache
            (one group per micro-batch); otherwise pack whole sequences into micro-batches.
        step: the optimizer step about to be taken (0 for the first), for the ECHO schedule.
        total_steps: the run's total steps (0: unbounded), for the ECHO schedule.
        dist: the trainer's ranks (every rank calls this with the same entries).
        top_p: the run's nucleus mass (widens the recompute check's limit below 1).
        recompute_limit: the recompute check's limit at temperature 1, top_p 1 (None: ``RECOMPUTE_LIMIT``;
            ``float("inf")`` turns the check off).
        probe: also probe the policy's bf16 rounding on the first group (``stoa.trainer.rounding``; the
            sequential test's calibration asks for it every few steps).

    Returns:
        flat metrics without the ``train/`` prefix; ``.disagreement`` holds the lag-0 values per worker and
        ``.rejected`` the groups the recompute check dropped (on rank 0; other ranks return empty metrics).
    """
    shared_prefix = shared_prefix and not policy.gradient_checkpointing
    t0 = time.perf_counter()
    batch = entries_batch(entries, algo, current_version)
    echo = step_echo(batch, algo, step, total_steps)
    micro, padding = rank_micro_batches(batch, dist, micro_batch, shared_prefix)
    check = RecomputeCheck(batch.group_ids, batch.version_lag, temperature=policy.temperature, top_p=top_p,
                           limit=recompute_limit)
    lag0: dict[str, list[tuple[int, int, np.ndarray]]] = {}

    def observe(idx: np.ndarray, logp: torch.Tensor) -> np.ndarray:
        _collect_lag0(batch, idx, logp, lag0, check)
        return check.keep(idx)

    acc = accumulate(algo, batch, micro, lambda idx: _forward(policy, ref, batch, idx, shared_prefix, echo),
                     to=lambda a: _tensor(a, policy.device), echo=echo, observe=observe)
    parts, loss_total, trained = acc.parts, acc.loss, acc.trained
    undo, undo_padding = _undo_batches(batch, check, trained, micro_batch, dist)
    # rows that trained before their group was rejected (packed mode): their loss is subtracted again
    loss_total += accumulate(algo, batch, undo, lambda idx: _forward(policy, ref, batch, idx, False, echo),
                             to=lambda a: _tensor(a, policy.device), echo=echo, sign=-1.0).loss
    padding += undo_padding
    for _ in range(padding):  # an empty share still joins every all-gather and reduce-scatter
        fw = _forward(policy, ref, batch, group_indices(batch)[0][:1], shared_prefix, echo)
        (fw.logp.sum() * 0.0).backward()
    rounding = finite(rounding_probe(policy, batch)) if probe and dist.main else []  # the weights that judged it
    grad_norm = _apply_update(policy, opt, grad_clip)
    shares = dist.gather((parts, loss_total, lag0, len(check.rejected), check.worst, check.residual,
                          check.rejected))
    if not dist.main:
        return StepMetrics({}, {})
    parts = [d for share in shares for d in share[0]]
    loss_total = sum(share[1] for share in shares)
    rejected = sum(share[3] for share in shares)
    for share in shares[1:]:
        for worker, values in share[2].items():
            lag0.setdefault(worker, []).extend(values)
    out = combine_metrics(parts)
    out.update(_step_figures(batch, loss_total, grad_norm, time.perf_counter() - t0))
    if echo.echo and echo.alpha is not None:
        out["echo_alpha"] = echo.alpha
    out["recompute_median_max"] = max(share[4] for share in shares)
    groups = {g: GroupCheck(v, g in share[6]) for share in shares for g, v in share[5].items()}
    if rounding:
        out["rounding_probe"] = rounding[0]
    return StepMetrics(out, _disagreement(batch, lag0), {"recompute": rejected} if rejected else {}, groups, rounding)


def rank_micro_batches(batch: Batch, dist: Dist, micro_batch: int, shared_prefix: bool
                       ) -> tuple[list[np.ndarray], int]:
    """This rank's micro-batches (row indices) and how many empty ones it adds so every rank runs as many.

    At world size 1: every row, in micro-batches of ``micro_batch`` rows (or one group each with
    ``shared_prefix``). With more ranks the groups are first split by tokens (``split_groups``); every rank computes
    the same split, so no message is needed.

    Args:
        batch: the step's batch.
        dist: the ranks.
        micro_batch: rows per micro-batch (packed mode).
        shared_prefix: one group per micro-batch.
    """
    groups = group_indices(batch)

    def chunks(gs: Sequence[int]) -> list[np.ndarray]:
        if shared_prefix:
            return [groups[g] for g in gs]
        rows = np.concatenate([groups[g] for g in gs]) if gs else np.zeros(0, np.int64)
        return [rows[m] for m in micro_batches(len(rows), micro_batch, lengths=batch.seq_lengths[rows])]

    if not dist.sharded:
        return chunks(range(len(groups))), 0
    tokens = [int(batch.seq_lengths[g].sum()) for g in groups]
    shares = [chunks(gs) for gs in split_groups(tokens, dist.world_size)]
    mine = shares[dist.rank]
    return mine, max(len(s) for s in shares) - len(mine)


def _forward(policy: Policy, ref: Reference | None, batch: Batch, idx: np.ndarray, shared_prefix: bool,
             echo: EchoStep) -> MicroForward:
    """The policy's logprobs of a micro-batch's rows [b, T] with gradient (argmax hits when the echo term is on) and
    the reference's logprobs (or None), on the positions ``echo.scored`` marks."""
    scored = echo.scored[idx]
    if shared_prefix:  # one group: its prompt runs once
        prompt, comps = batch.rows[int(idx[0])].prompt, [batch.rows[int(i)].tokens for i in idx]
        if echo.hits:
            fw = policy.group_score(prompt, comps, batch.width, scored, hits=True)
        else:
            fw = Scores(policy.group_logprobs(prompt, comps, batch.width, scored), None)
        with torch.no_grad():
            ref_lp = ref.group_logprobs(prompt, comps, batch.width, scored) if ref is not None else None
        return MicroForward(fw.logp, fw.hits, ref_lp)
    packed = to_device(pack(batch, idx), policy.device, scored)
    with torch.no_grad():
        ref_lp = ref.logprobs(packed) if ref is not None else None
    fw = policy.score(packed, hits=True) if echo.hits else Scores(policy.logprobs(packed), None)
    return MicroForward(fw.logp, fw.hits, ref_lp)


def _tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A numpy array as a tensor on ``device``."""
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def _apply_update(policy: Policy, opt: torch.optim.Optimizer, grad_clip: float) -> float:
    """Clip the accumulated gradients (0: no clip), step, clear, refresh a bf16 compute copy from the masters;
    returns the pre-clip global norm."""
    norm = clip_and_step([p for p in policy.model.parameters() if p.grad is not None], opt, grad_clip)
    policy.refresh_copy()
    return norm


def _step_figures(batch: Batch, loss: float, grad_norm: float, seconds: float) -> dict[str, float]:
    """The step's own figures next to the algorithm's diagnostics."""
    n_tokens = int(batch.mask.sum())
    return {"loss": loss, "grad_norm": grad_norm, "step_time_s": seconds, "tokens": float(n_tokens),
            "tokens_per_s": n_tokens / seconds if seconds > 0 else 0.0, "sequences": float(len(batch)),
            "groups": float(len(batch.rewards)), "adv_abs_mean": float(np.abs(batch.advantages).mean())}


def _collect_lag0(batch: Batch, idx: np.ndarray, logp: torch.Tensor,
                  out: dict[str, list[tuple[int, int, np.ndarray]]], check: RecomputeCheck) -> None:
    """Append (its group, its lag, ``exp|recorded - recomputed| - 1`` of its tokens) of each row to
    ``out[its worker]`` (lagged rows too: the sequential test judges them against the fleet at their lag), and
    judge the lag-0 rows (``check``)."""
    with torch.no_grad():
        recomputed = logp.detach().float().cpu().numpy()
    check.judge(idx, batch.rollout_logp[idx], recomputed, batch.mask[idx])
    for i, vals in zip(idx, disagreement_values(batch.rollout_logp[idx], recomputed), strict=True):
        out.setdefault(batch.sources[i], []).append((int(batch.group_ids[i]), int(batch.version_lag[i]),
                                                     vals[batch.mask[i] > 0]))


def _undo_batches(batch: Batch, check: RecomputeCheck, trained: Sequence[np.ndarray], micro_batch: int, dist: Dist
                  ) -> tuple[list[np.ndarray], int]:
    """Micro-batches of the rows whose loss was accumulated before their group was rejected (a group split over
    micro-batches in packed mode), and the empty ones this rank adds so every rank runs as many forwards.

    Args:
        batch: the step's batch.
        check: the step's recompute check (every row judged).
        trained: per micro-batch, the rows whose loss it accumulated.
        micro_batch: rows per micro-batch.
        dist: the ranks.
    """
    rows = np.concatenate(trained) if trained else np.zeros(0, np.int64)
    rows = rows[check.keep(rows) == 0] if check.rejected else rows[:0]
    mine = [rows[m] for m in micro_batches(len(rows), micro_batch, lengths=batch.seq_lengths[rows])] if len(
        rows) else []
    if not dist.sharded:
        return mine, 0
    counts = dist.gather(len(mine))
    most = int(dist.broadcast(max(counts) if counts else 0))
    return mine, most - len(mine)


def _disagreement(batch: Batch, lag0: dict[str, list[tuple[int, int, np.ndarray]]]) -> dict[str, Disagreement]:
    """Per worker: its lag-0 values of this step, how many lag-0 records (groups) they came from, and every
    record's values with its lag (in group order, for the sequential test)."""
    records: dict[str, int] = {}
    for idx in group_indices(batch):
        first = int(idx[0])
        if batch.version_lag[first] == 0:
            records[batch.sources[first]] = records.get(batch.sources[first], 0) + 1
    out = {}
    for w, rows in lag0.items():
        by_group: dict[int, list[np.ndarray]] = {}
        lags: dict[int, int] = {}
        for g, lag, v in sorted(rows, key=lambda r: r[0]):
            by_group.setdefault(g, []).append(v)
            lags[g] = lag
        per_record = tuple(np.concatenate(vs) for vs in by_group.values())
        at0 = [v for _, lag, v in rows if lag == 0]
        out[w] = Disagreement(np.concatenate(at0) if at0 else np.zeros(0), records.get(w, 0), per_record,
                              tuple(lags.values()))
    return out


def episode_figures(entries: list[Entry], ps: PoolStats, step_s: float) -> dict[str, float]:
    """A multi-turn step's figures: its episodes' search rate, turns, tool calls and end reasons
    (``rollout/*``), the replay's tool calls since the last step, and the share of the trainer's time spent
    re-executing tool calls (``train/replay_share`` = replay seconds / (replay + step seconds)); {} for
    single-turn entries.

    Args:
        entries: the step's groups (multi-turn ones carry the pool's ``replayed``).
        ps: the pool's counters since the last step (``replay_s``, ``tool_calls``).
        step_s: the optimizer step's seconds.
    """
    groups = [e.record.samples for e in entries if e.replayed is not None]
    if not groups:
        return {}
    out = episode_metrics(groups, "rollout/")
    total = ps.replay_s + step_s
    out.update({"rollout/tool_calls": float(ps.tool_calls), "rollout/unreplayed": float(ps.unreplayed),
                "train/replay_s": ps.replay_s,
                "train/replay_share": ps.replay_s / total if total > 0 else 0.0})
    return out
