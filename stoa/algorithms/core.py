"""Shared loss math, written once against the Ops shim: ratio, clipping, dual-clip, DPPO gate, TIS, KL, reductions."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from stoa.algorithms.base import Reduction
from stoa.algorithms.diagnostics import _denominator
from stoa.algorithms.ops import Ops

LOG_RATIO_BOUND = 20.0
"""Log-ratios (and KL log-differences) are clamped to +-20 before exp: no overflow, no gradient past it."""

_LOG1M_FLOOR = 1e-12


def log_ratio(ops: Ops, logp: Any, behaviour_logp: Any, mask: Any) -> Any:
    """log(pi / mu) per token, 0 off the mask, clamped to +-LOG_RATIO_BOUND.

    Args:
        ops: the backend shim.
        logp: [B, T] current-policy logprobs (differentiable).
        behaviour_logp: [B, T] worker-recorded logprobs.
        mask: [B, T] float mask.
    """
    lr = ops.where(mask > 0, logp - behaviour_logp, 0.0)
    return ops.clip(lr, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def clipped_surrogate(ops: Ops, ratio: Any, adv: Any, eps_low: float, eps_high: float,
                      dual_clip_c: float | None) -> Any:
    """PPO's clipped loss -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), optionally dual-clipped.

    With ``dual_clip_c`` the loss of negative-advantage entries is capped at c * |A|
    (-max(min(rA, clip(r)A), cA)). Works element-wise on tokens [B, T] or sequences [B].

    The regimes are chosen by strict inequalities on the detached ratio (A > 0 and r > 1 + eps_high,
    A < 0 and r < 1 - eps_low, A < 0 and r > c), the same ones ``clip_regimes`` counts: a ratio exactly
    on a bound keeps its gradient on every backend and version (``maximum`` at a tie splits it).

    Args:
        ops: the backend shim.
        ratio: importance ratios (differentiable).
        adv: advantages broadcastable to ``ratio``.
        eps_low: lower clip (1 - eps_low).
        eps_high: upper clip (1 + eps_high); may be inf.
        dual_clip_c: the dual-clip bound (> 1) or None.
    """
    r = ops.stop_gradient(ratio)
    loss = -ratio * adv
    if math.isfinite(eps_high):
        hi = 1.0 + eps_high
        loss = ops.where((adv > 0) * (r > hi), -hi * adv, loss)
    lo = 1.0 - eps_low
    loss = ops.where((adv < 0) * (r < lo), -lo * adv, loss)
    if dual_clip_c is not None:
        loss = ops.where((adv < 0) * (r > dual_clip_c), -dual_clip_c * adv, loss)
    return loss


def clip_regimes(ops: Ops, ratio: Any, adv: Any, eps_low: float, eps_high: float,
                 dual_clip_c: float | None) -> dict[str, Any]:
    """0/1 float indicators of where ``clipped_surrogate`` has no gradient, by cause.

    Returns keys 'clip_low' (A < 0, r < 1 - eps_low), 'clip_high' (A > 0, r > 1 + eps_high) and
    'dual_clip' (A < 0, r > c; zeros without dual-clip).

    Args:
        ops: the backend shim.
        ratio: importance ratios.
        adv: advantages broadcastable to ``ratio``.
        eps_low: lower clip.
        eps_high: upper clip.
        dual_clip_c: the dual-clip bound or None.
    """
    r = ops.stop_gradient(ratio)
    neg = ops.f32(adv < 0)
    out = {
        "clip_low": neg * ops.f32(r < 1.0 - eps_low),
        "clip_high": ops.f32(adv > 0) * ops.f32(r > 1.0 + eps_high),
    }
    out["dual_clip"] = neg * ops.f32(r > dual_clip_c) if dual_clip_c is not None else neg * 0.0
    return out


def _log1m_exp(ops: Ops, log_x: Any) -> Any:
    return ops.log(ops.clip(-ops.expm1(log_x), _LOG1M_FLOOR, None))


def binary_kl(ops: Ops, log_mu: Any, log_p: Any) -> Any:
    """KL(Bernoulli(mu) || Bernoulli(p)) = mu log(mu/p) + (1-mu) log((1-mu)/(1-p)), from log mu, log p.

    Args:
        ops: the backend shim.
        log_mu: behaviour log-probability of the sampled token.
        log_p: current log-probability of the sampled token.
    """
    mu = ops.exp(log_mu)
    return mu * (log_mu - log_p) + (1.0 - mu) * (_log1m_exp(ops, log_mu) - _log1m_exp(ops, log_p))


def gate_blocked(ops: Ops, logp: Any, behaviour_logp: Any, adv: Any, mask: Any, kind: str,
                 delta_low: float, delta_high: float) -> Any:
    """DPPO binary trust-region gate: 0/1 float [B, T], 1 where the token is dropped (no gradient).

    With p = exp(logp) (detached) and mu = exp(behaviour_logp): for A > 0 a token is dropped when p
    rose past the threshold, for A < 0 when p fell past it. 'tv' measures |p - mu| (the binary total
    variation); 'kl' measures the binary KL(Bernoulli(mu) || Bernoulli(p)) and uses the sign of
    p - mu for the direction. Tokens moving against the advantage's push are never dropped.

    Args:
        ops: the backend shim.
        logp: [B, T] current logprobs.
        behaviour_logp: [B, T] worker logprobs.
        adv: [B, 1] advantages.
        mask: [B, T] float mask (off-mask entries are never blocked).
        kind: 'tv' or 'kl'.
        delta_low: threshold for negative advantages.
        delta_high: threshold for positive advantages.
    """
    on = mask > 0
    log_p = ops.where(on, ops.stop_gradient(logp), 0.0)
    log_mu = ops.where(on, behaviour_logp, 0.0)
    p, mu = ops.exp(log_p), ops.exp(log_mu)
    if kind == "tv":
        up = ops.f32(p - mu > delta_high)
        down = ops.f32(mu - p > delta_low)
    elif kind == "kl":
        kl = binary_kl(ops, log_mu, log_p)
        up = ops.f32(p > mu) * ops.f32(kl > delta_high)
        down = ops.f32(p < mu) * ops.f32(kl > delta_low)
    else:
        raise ValueError(f"gate: unknown gate {kind!r}")
    return (ops.f32(adv > 0) * up + ops.f32(adv < 0) * down) * ops.f32(on)


def truncation_weight(ops: Ops, lr: Any, cap: float) -> Any:
    """stop_grad(min(r, cap) / r) from log r: multiplying r-weighted terms by it truncates r at cap.

    Args:
        ops: the backend shim.
        lr: log importance ratios.
        cap: the truncation cap (> 0).
    """
    return ops.stop_gradient(ops.exp(ops.clip(math.log(cap) - lr, None, 0.0)))


def kl_per_token(ops: Ops, logp: Any, ref_logp: Any, mask: Any, estimator: str) -> Any:
    """Per-token KL(pi || ref) estimate on d = logp - ref_logp (0 off the mask).

    k1 = d, k2 = d^2 / 2, k3 = exp(-d) + d - 1 (Schulman, "Approximating KL divergence"); d is
    clamped to +-LOG_RATIO_BOUND.

    Args:
        ops: the backend shim.
        logp: [B, T] current logprobs (differentiable).
        ref_logp: [B, T] reference logprobs.
        mask: [B, T] float mask.
        estimator: 'k1', 'k2' or 'k3'.
    """
    d = ops.clip(ops.where(mask > 0, logp - ref_logp, 0.0), -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return ops.exp(-d) + d - 1.0
    raise ValueError(f"kl_estimator: unknown estimator {estimator!r}")


def echo_nll(ops: Ops, logp: Any, echo_mask: Any) -> Any:
    """The ECHO term's micro-batch sum of -logp over the echo tokens (differentiable; no ratio, no KL).

    Only echo positions are read (``where``), so junk logprobs elsewhere never reach value or gradient.

    Args:
        ops: the backend shim.
        logp: [B, T] current-policy logprobs of the targets.
        echo_mask: [B, T] float, 1 on echo tokens.
    """
    return -ops.sum(ops.where(echo_mask > 0, logp, 0.0) * echo_mask)


def reduce_tokens(ops: Ops, per_token: Any, mask: Any, normalizer: float, reduction: Reduction) -> Any:
    """Micro-batch share of a token-level loss; shares of all micro-batches sum to the batch loss.

    'token_mean' and 'seq_mean_token_sum_norm' divide the masked token sum by the batch normaliser;
    'seq_mean_token_mean' and 'seq_mean' first average each sequence over its own tokens.

    Args:
        ops: the backend shim.
        per_token: [B, T] per-token loss.
        mask: [B, T] float mask.
        normalizer: the whole batch's normaliser (``normalizer_for``).
        reduction: the algorithm's reduction.
    """
    masked = per_token * mask
    if reduction in ("token_mean", "seq_mean_token_sum_norm"):
        return ops.sum(masked) / normalizer
    if reduction in ("seq_mean_token_mean", "seq_mean"):
        per_seq = ops.sum(masked, axis=1) / ops.clip(ops.sum(mask, axis=1), 1.0, None)
        return ops.sum(per_seq) / normalizer
    raise ValueError(f"reduction: unknown reduction {reduction!r}")


def reduce_seqs(ops: Ops, per_seq: Any, mask: Any, normalizer: float) -> Any:
    """Micro-batch share of a sequence-level loss [B] (rows without tokens count for nothing).

    Args:
        ops: the backend shim.
        per_seq: [B] per-sequence loss.
        mask: [B, T] float mask.
        normalizer: the whole batch's number of sequences.
    """
    has = ops.f32(ops.sum(mask, axis=1) > 0)
    return ops.sum(per_seq * has) / normalizer


def normalizer_for(reduction: Reduction, mask_all: np.ndarray, max_tokens: int | None = None) -> float:
    """The whole batch's loss denominator for a reduction (>= 1, so an empty batch gives loss 0).

    token count for 'token_mean'; number of sequences with a token for 'seq_mean_token_mean' and
    'seq_mean'; that times ``max_tokens`` for 'seq_mean_token_sum_norm' (Dr.GRPO).

    Args:
        reduction: the algorithm's reduction.
        mask_all: [B, T] mask of the whole batch (numpy or array-like).
        max_tokens: the constant length of 'seq_mean_token_sum_norm'.
    """
    m = np.asarray(mask_all, dtype=np.float64)
    if m.ndim != 2:
        raise ValueError(f"mask_all: expected [B, T], got shape {m.shape}")
    if reduction == "token_mean":
        value = float(m.sum())
    elif reduction in ("seq_mean_token_mean", "seq_mean"):
        value = float((m.sum(axis=1) > 0).sum())
    elif reduction == "seq_mean_token_sum_norm":
        if max_tokens is None:
            raise ValueError("max_tokens: needed by the 'seq_mean_token_sum_norm' reduction")
        value = float((m.sum(axis=1) > 0).sum()) * max_tokens
    else:
        raise ValueError(f"reduction: unknown reduction {reduction!r}")
    return max(value, 1.0)


def diagnostics(ops: Ops, *, sums: Mapping[str, Any], maxes: Mapping[str, Any] | None = None,
                values: Mapping[str, Any] | None = None, per_seq_blocked: Any = None, mask: Any = None,
                version_lag: np.ndarray | Sequence[int] | None = None) -> dict[str, float]:
    """Turn device sums into the diagnostics dict with one device round trip (plus one for lags).

    Keys of ``sums`` that have a denominator in ``metrics.METRIC_DENOMINATORS`` become fractions/means
    of it (0 when it is 0); the rest (counts) are reported as they are.

    Args:
        ops: the backend shim.
        sums: metric name -> 0-d masked sum (numerators and denominators alike).
        maxes: metric name -> 0-d value reported as it is (e.g. ratio_max).
        values: metric name -> 0-d value reported as it is (e.g. the loss parts).
        per_seq_blocked: optional [B] gated-token counts per sequence, for gate_frac_lag{k}.
        mask: [B, T] mask (needed with ``per_seq_blocked``).
        version_lag: optional [B] version lags.
    """
    extra = {**(maxes or {}), **(values or {})}
    keys = list(sums) + list(extra)
    floats = dict(zip(keys, ops.to_floats([*sums.values(), *extra.values()]), strict=True))
    out: dict[str, float] = {}
    for k in sums:
        den = _denominator(k)
        if den is None:
            out[k] = floats[k]
        else:
            d = floats[den]
            out[k] = floats[k] / d if d > 0 else 0.0
    for k in extra:
        out[k] = floats[k]
    if version_lag is not None and per_seq_blocked is not None and mask is not None:
        lag = np.asarray(version_lag).reshape(-1).astype(np.int64)
        blocked = ops.to_numpy(per_seq_blocked).reshape(-1)
        tokens = ops.to_numpy(ops.sum(mask, axis=1)).reshape(-1)
        if lag.shape != tokens.shape:
            raise ValueError(f"version_lag: expected {tokens.shape[0]} entries, got {lag.shape[0]}")
        for k in np.unique(lag):
            sel = lag == k
            n = float(tokens[sel].sum())
            out[f"tokens_lag{int(k)}"] = n
            out[f"gate_frac_lag{int(k)}"] = float(blocked[sel].sum()) / n if n > 0 else 0.0
    return out
