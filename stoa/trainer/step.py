"""One optimizer step over a batch of groups, for any algorithm behind the Algorithm protocol."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from stoa.trainer.policy import Policy, pack
from stoa.trainer.pool import Entry


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
) -> dict[str, float]:
    """Compute advantages, accumulate the loss over micro-batches, clip, and step the optimizer.

    The loss normaliser comes from the whole batch, so the sum over micro-batches equals the
    whole-batch loss exactly (tested).

    Args:
        policy: the trainable policy.
        ref: frozen reference policy, or ``None`` when the KL coefficient is 0.
        opt: the optimizer.
        algo: an ``Algorithm`` (torch backend).
        entries: the groups of this step.
        current_version: the policy version being trained (for lag diagnostics).
        micro_batch: sequences per forward/backward (packed mode).
        grad_clip: max global gradient norm (0 disables).
        shared_prefix: run each group's prompt once and its completions on the shared KV cache
            (one group per micro-batch); otherwise pack whole sequences into micro-batches.

    Returns:
        flat metrics without the ``train/`` prefix.
    """
    from stoa.algorithms import LossInputs, combine_metrics

    shared_prefix = shared_prefix and not policy.gradient_checkpointing

    t0 = time.perf_counter()
    rewards = np.stack([e.rewards for e in entries]).astype(np.float32)  # [G, n]
    lengths = np.array([[len(s.tokens) for s in e.record.samples] for e in entries], dtype=np.int64)
    adv = np.asarray(algo.advantages(rewards, lengths), dtype=np.float32)
    rows = []  # (prompt, completion, behaviour logprobs, advantage, lag)
    for gi, e in enumerate(entries):
        lag = current_version - e.record.policy_version
        for si, s in enumerate(e.record.samples):
            rows.append((e.record.prompt_tokens, s.tokens, s.logprobs, float(adv[gi, si]), lag))
    t_max = int(lengths.max())
    mask_all = np.zeros((len(rows), t_max), dtype=np.float32)
    for i, r in enumerate(rows):
        mask_all[i, : len(r[1])] = 1.0
    normalizer = float(algo.normalizer(mask_all))
    dev = policy.device
    parts: list[dict[str, float]] = []
    loss_total = 0.0
    n_tokens = int(mask_all.sum())
    for idx in _micro_batches(rows, entries, micro_batch, shared_prefix):
        chunk = [rows[i] for i in idx]
        beh = np.zeros((len(chunk), t_max), dtype=np.float32)
        for j, r in enumerate(chunk):
            beh[j, : len(r[2])] = r[2]
        if shared_prefix:  # one group: its prompt runs once
            prompt, comps = chunk[0][0], [r[1] for r in chunk]
            logp = policy.group_logprobs(prompt, comps, t_max)
            mask = torch.from_numpy(mask_all[idx]).to(dev)
            ref_fn = (lambda pr=prompt, cs=comps: ref.group_logprobs(pr, cs, t_max)) if ref is not None else None
        else:
            packed = pack([r[0] for r in chunk], [r[1] for r in chunk], t_max, dev)
            logp, mask = policy.logprobs(packed), packed.mask
            ref_fn = (lambda pk=packed: ref.logprobs(pk)) if ref is not None else None
        ref_lp = None
        if ref_fn is not None:
            with torch.no_grad():
                ref_lp = ref_fn()
        inp = LossInputs(
            logp=logp,
            behaviour_logp=torch.from_numpy(beh).to(dev),
            ref_logp=ref_lp,
            advantages=torch.tensor([r[3] for r in chunk], dtype=torch.float32, device=dev),
            mask=mask,
            normalizer=normalizer,
            version_lag=np.array([r[4] for r in chunk], dtype=np.int64),
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
    return out


def _micro_batches(rows: list, entries: Sequence[Entry], micro_batch: int, shared_prefix: bool) -> list[list[int]]:
    """Row indices per micro-batch: one group each with a shared prefix, else length-sorted chunks."""
    if shared_prefix:
        out, start = [], 0
        for e in entries:
            out.append(list(range(start, start + len(e.record.samples))))
            start += len(e.record.samples)
        return out
    order = sorted(range(len(rows)), key=lambda i: -(len(rows[i][0]) + len(rows[i][1])))
    return [order[i : i + micro_batch] for i in range(0, len(order), micro_batch)]
