"""One optimizer step over a batch of groups, for any algorithm behind the Algorithm protocol."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from stoa.layout import rollout_worker
from stoa.trainer.policy import Policy, pack
from stoa.trainer.pool import Entry
from stoa.trainer.quarantine import Disagreement


class _Row(NamedTuple):
    """One completion of the batch."""

    prompt: np.ndarray
    completion: np.ndarray
    behaviour: np.ndarray  # the worker's recorded logprobs
    advantage: float
    lag: int  # current_version - the record's policy version
    worker: str


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


def train_step(
    policy: Policy,
    ref: Policy | None,
    opt: torch.optim.Optimizer,
    algo: Any,
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
        algo: an ``Algorithm`` (torch backend).
        entries: the groups of this step.
        current_version: the policy version being trained (lag 0 means sampled with these weights).
        micro_batch: sequences per forward/backward (packed mode).
        grad_clip: max global gradient norm (0 disables).
        shared_prefix: run each group's prompt once and its completions on the shared KV cache
            (one group per micro-batch); otherwise pack whole sequences into micro-batches.

    Returns:
        flat metrics without the ``train/`` prefix; ``.disagreement`` holds the lag-0 values per worker.
    """
    from stoa.algorithms import LossInputs, combine_metrics

    shared_prefix = shared_prefix and not policy.gradient_checkpointing

    t0 = time.perf_counter()
    rewards = np.stack([e.rewards for e in entries]).astype(np.float32)  # [G, n]
    lengths = np.array([[len(s.tokens) for s in e.record.samples] for e in entries], dtype=np.int64)
    adv = np.asarray(algo.advantages(rewards, lengths), dtype=np.float32)
    rows = _rows(entries, adv, current_version)
    t_max = int(lengths.max())
    mask_all = np.zeros((len(rows), t_max), dtype=np.float32)
    for i, r in enumerate(rows):
        mask_all[i, : len(r.completion)] = 1.0
    normalizer = float(algo.normalizer(mask_all))
    dev = policy.device
    parts: list[dict[str, float]] = []
    lag0: dict[str, list[np.ndarray]] = {}
    loss_total = 0.0
    n_tokens = int(mask_all.sum())
    for idx in _micro_batches(rows, entries, micro_batch, shared_prefix):
        chunk = [rows[i] for i in idx]
        beh = np.zeros((len(chunk), t_max), dtype=np.float32)
        for j, r in enumerate(chunk):
            beh[j, : len(r.behaviour)] = r.behaviour
        logp, mask, ref_lp = _forward(policy, ref, chunk, mask_all[idx], t_max, shared_prefix)
        _collect_lag0(chunk, logp, beh, lag0)
        inp = LossInputs(
            logp=logp,
            behaviour_logp=torch.from_numpy(beh).to(dev),
            ref_logp=ref_lp,
            advantages=torch.tensor([r.advantage for r in chunk], dtype=torch.float32, device=dev),
            mask=mask,
            normalizer=normalizer,
            version_lag=np.array([r.lag for r in chunk], dtype=np.int64),
        )
        loss, diag = algo.loss(inp)
        loss.backward()
        loss_total += float(loss.detach())
        parts.append(diag)
    params = [p for p in policy.model.parameters() if p.grad is not None]
    gn = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    opt.step()
    opt.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0
    out = combine_metrics(parts)
    out.update(
        loss=loss_total,
        grad_norm=float(gn),
        step_time_s=dt,
        tokens=float(n_tokens),
        tokens_per_s=n_tokens / dt if dt > 0 else 0.0,
        sequences=float(len(rows)),
        groups=float(len(entries)),
        adv_abs_mean=float(np.abs(adv).mean()),
    )
    return StepMetrics(out, _disagreement(entries, lag0, current_version))


def _forward(policy: Policy, ref: Policy | None, chunk: list[_Row], mask: np.ndarray, t_max: int,
             shared_prefix: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Logprobs of a micro-batch (with gradient), its token mask, and the reference's logprobs (or None)."""
    dev = policy.device
    if shared_prefix:  # one group: its prompt runs once
        prompt, comps = chunk[0].prompt, [r.completion for r in chunk]
        logp, mask_t = policy.group_logprobs(prompt, comps, t_max), torch.from_numpy(mask).to(dev)
        with torch.no_grad():
            return logp, mask_t, ref.group_logprobs(prompt, comps, t_max) if ref is not None else None
    packed = pack([r.prompt for r in chunk], [r.completion for r in chunk], t_max, dev)
    with torch.no_grad():
        ref_lp = ref.logprobs(packed) if ref is not None else None
    return policy.logprobs(packed), packed.mask, ref_lp


def _rows(entries: Sequence[Entry], adv: np.ndarray, current_version: int) -> list[_Row]:
    """One row per completion, in entry order."""
    rows = []
    for gi, e in enumerate(entries):
        lag, worker = current_version - e.record.policy_version, entry_worker(e)
        for si, s in enumerate(e.record.samples):
            rows.append(_Row(e.record.prompt_tokens, s.tokens, s.logprobs, float(adv[gi, si]), lag, worker))
    return rows


def _collect_lag0(chunk: list[_Row], logp: torch.Tensor, beh: np.ndarray,
                  out: dict[str, list[np.ndarray]]) -> None:
    """Append ``exp|recorded - recomputed| - 1`` of each lag-0 row's tokens to ``out[worker]``."""
    rows = [j for j, r in enumerate(chunk) if r.lag == 0]
    if not rows:
        return
    with torch.no_grad():
        recomputed = logp.detach()[rows].float().cpu().numpy().astype(np.float64)
    vals = np.expm1(np.abs(recomputed - beh[rows].astype(np.float64)))
    for i, j in enumerate(rows):
        out.setdefault(chunk[j].worker, []).append(vals[i, : len(chunk[j].completion)])


def _disagreement(entries: Sequence[Entry], lag0: dict[str, list[np.ndarray]], current_version: int
                  ) -> dict[str, Disagreement]:
    """Per worker: its lag-0 values of this step and how many lag-0 records they came from."""
    records: dict[str, int] = {}
    for e in entries:
        if e.record.policy_version == current_version:
            records[entry_worker(e)] = records.get(entry_worker(e), 0) + 1
    return {w: Disagreement(np.concatenate(v), records.get(w, 0)) for w, v in lag0.items()}


def _micro_batches(rows: list[_Row], entries: Sequence[Entry], micro_batch: int, shared_prefix: bool
                   ) -> list[list[int]]:
    """Row indices per micro-batch: one group each with a shared prefix, else length-sorted chunks."""
    if shared_prefix:
        out, start = [], 0
        for e in entries:
            out.append(list(range(start, start + len(e.record.samples))))
            start += len(e.record.samples)
        return out
    order = sorted(range(len(rows)), key=lambda i: -(len(rows[i].prompt) + len(rows[i].completion)))
    return [order[i : i + micro_batch] for i in range(0, len(order), micro_batch)]
