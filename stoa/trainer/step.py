"""One optimizer step over a batch of groups, for any algorithm behind the Algorithm protocol."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from stoa.algorithms import Algorithm, LossInputs, combine_metrics
from stoa.algorithms.batch import Batch, Packed, Trajectory, build_batch, group_indices, micro_batches, pack
from stoa.layout import rollout_worker
from stoa.trainer.policy import Packed as TorchPacked
from stoa.trainer.policy import Policy
from stoa.trainer.pool import Entry
from stoa.trainer.quarantine import Disagreement, disagreement_values


class StepMetrics(dict):
    """``train_step``'s flat float metrics (a plain ``dict[str, float]`` to its callers), plus
    ``disagreement``: per worker id, its lag-0 tokens' ``exp|recorded - recomputed| - 1``
    (see ``stoa.trainer.quarantine``), measured on the logprobs the step computes anyway."""

    def __init__(self, metrics: dict[str, float], disagreement: dict[str, Disagreement]):
        super().__init__(metrics)
        self.disagreement = disagreement


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

    Args:
        entries: the groups of this step (through the algorithm's group filter at intake).
        algo: the algorithm.
        current_version: the policy version being trained.
    """
    groups = [[Trajectory.single_turn(e.record.prompt_tokens, s.tokens, s.logprobs, float(r), s.finish_reason)
               for s, r in zip(e.record.samples, e.rewards, strict=True)] for e in entries]
    lags = [current_version - e.record.policy_version for e in entries]
    batch = build_batch(groups, algo, version_lag=lags, sources=[entry_worker(e) for e in entries])
    batch.old_logp = batch.rollout_logp
    return batch


def train_step(
    policy: Policy,
    ref: Policy | None,
    opt: torch.optim.Optimizer,
    algo: Algorithm,
    entries: Sequence[Entry],
    *,
    current_version: int,
    micro_batch: int,
    grad_clip: float,
    shared_prefix: bool = True,
) -> StepMetrics:
    """Compute advantages, accumulate the loss over micro-batches, clip, and step the optimizer.

    The loss normaliser comes from the whole batch, so the sum over micro-batches equals the
    whole-batch loss exactly (tested).

    Args:
        policy: the trainable policy.
        ref: frozen reference policy, or ``None`` when the KL coefficient is 0.
        opt: the optimizer.
        algo: the algorithm (torch backend).
        entries: the groups of this step.
        current_version: the policy version being trained (lag 0 means sampled with these weights).
        micro_batch: sequences per forward/backward (packed mode).
        grad_clip: max global gradient norm (0 disables).
        shared_prefix: run each group's prompt once and its completions on the shared KV cache
            (one group per micro-batch); otherwise pack whole sequences into micro-batches.

    Returns:
        flat metrics without the ``train/`` prefix; ``.disagreement`` holds the lag-0 values per worker.
    """
    shared_prefix = shared_prefix and not policy.gradient_checkpointing
    t0 = time.perf_counter()
    batch = entries_batch(entries, algo, current_version)
    if shared_prefix:
        micro = group_indices(batch)
    else:
        micro = micro_batches(len(batch), micro_batch, lengths=batch.seq_lengths)
    parts: list[dict[str, float]] = []
    lag0: dict[str, list[np.ndarray]] = {}
    loss_total = 0.0
    for idx in micro:
        logp, ref_lp = _forward(policy, ref, batch, idx, shared_prefix)
        _collect_lag0(batch, idx, logp, lag0)
        loss, diag = algo.loss(_loss_inputs(batch, idx, logp, ref_lp, policy.device))
        loss.backward()
        loss_total += float(loss.detach())
        parts.append(diag)
    grad_norm = _apply_update(policy, opt, grad_clip)
    out = combine_metrics(parts)
    out.update(_step_figures(batch, loss_total, grad_norm, time.perf_counter() - t0))
    return StepMetrics(out, _disagreement(batch, lag0))


def _forward(policy: Policy, ref: Policy | None, batch: Batch, idx: np.ndarray, shared_prefix: bool
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs [b, T] of a micro-batch's rows (with gradient) and the reference's (or None)."""
    if shared_prefix:  # one group: its prompt runs once
        prompt, comps = batch.rows[int(idx[0])].prompt, [batch.rows[int(i)].tokens for i in idx]
        logp = policy.group_logprobs(prompt, comps, batch.width)
        with torch.no_grad():
            return logp, ref.group_logprobs(prompt, comps, batch.width) if ref is not None else None
    packed = _on_device(pack(batch, idx), policy.device)
    with torch.no_grad():
        ref_lp = ref.logprobs(packed) if ref is not None else None
    return policy.logprobs(packed), ref_lp


def _on_device(pk: Packed, device: torch.device) -> TorchPacked:
    """The policy's tensors of a packed micro-batch."""
    def long(a: np.ndarray) -> torch.Tensor:
        return _tensor(a, device).long()

    return TorchPacked(long(pk.input_ids), long(pk.attention_mask), long(pk.pos), long(pk.targets),
                       _tensor(pk.mask, device))


def _loss_inputs(batch: Batch, idx: np.ndarray, logp: torch.Tensor, ref_lp: torch.Tensor | None,
                 device: torch.device) -> LossInputs[torch.Tensor]:
    """The algorithm's inputs for the rows ``idx``: their old-policy logprobs, advantages, mask and lags."""
    assert batch.old_logp is not None  # entries_batch sets the workers' logprobs
    return LossInputs(logp=logp, behaviour_logp=_tensor(batch.old_logp[idx], device), ref_logp=ref_lp,
                      advantages=_tensor(batch.advantages[idx], device),
                      mask=_tensor(batch.mask[idx], device), normalizer=batch.normalizer,
                      version_lag=batch.version_lag[idx])


def _tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A numpy array as a tensor on ``device``."""
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def _apply_update(policy: Policy, opt: torch.optim.Optimizer, grad_clip: float) -> float:
    """Clip the accumulated gradients (0: no clip), step, clear; returns the pre-clip global norm."""
    params = [p for p in policy.model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(norm)


def _step_figures(batch: Batch, loss: float, grad_norm: float, seconds: float) -> dict[str, float]:
    """The step's own figures next to the algorithm's diagnostics."""
    n_tokens = int(batch.mask.sum())
    return {"loss": loss, "grad_norm": grad_norm, "step_time_s": seconds, "tokens": float(n_tokens),
            "tokens_per_s": n_tokens / seconds if seconds > 0 else 0.0, "sequences": float(len(batch)),
            "groups": float(len(batch.rewards)), "adv_abs_mean": float(np.abs(batch.advantages).mean())}


def _collect_lag0(batch: Batch, idx: np.ndarray, logp: torch.Tensor, out: dict[str, list[np.ndarray]]
                  ) -> None:
    """Append ``exp|recorded - recomputed| - 1`` of each lag-0 row's tokens to ``out[its worker]``."""
    sel = [j for j, i in enumerate(idx) if batch.version_lag[i] == 0]
    if not sel:
        return
    with torch.no_grad():
        recomputed = logp.detach()[sel].float().cpu().numpy()
    rows = idx[sel]
    for i, vals in zip(rows, disagreement_values(batch.rollout_logp[rows], recomputed), strict=True):
        out.setdefault(batch.sources[i], []).append(vals[batch.mask[i] > 0])


def _disagreement(batch: Batch, lag0: dict[str, list[np.ndarray]]) -> dict[str, Disagreement]:
    """Per worker: its lag-0 values of this step and how many lag-0 records (groups) they came from."""
    records: dict[str, int] = {}
    for idx in group_indices(batch):
        first = int(idx[0])
        if batch.version_lag[first] == 0:
            records[batch.sources[first]] = records.get(batch.sources[first], 0) + 1
    return {w: Disagreement(np.concatenate(v), records.get(w, 0)) for w, v in lag0.items()}
