"""Merging the loss diagnostics of the micro-batches of one step (backend-free)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# Fractions and means are over the micro-batch; merging weights each by its denominator key.
METRIC_DENOMINATORS: dict[str, str] = {
    "clip_frac_low": "tokens",
    "clip_frac_high": "tokens",
    "dual_clip_frac": "tokens",
    "tis_frac": "tokens",
    "gate_frac": "tokens",
    "gate_frac_pos": "tokens_pos",
    "gate_frac_neg": "tokens_neg",
    "ratio_mean": "tokens",
    "kl": "tokens",
    "entropy_proxy": "tokens",
    "seq_clip_frac_low": "seqs",
    "seq_clip_frac_high": "seqs",
    "seq_dual_clip_frac": "seqs",
    "seq_tis_frac": "seqs",
    "seq_ratio_mean": "seqs",
    "loss_echo": "echo_tokens",
    "echo_acc": "echo_tokens",
}
SUMMED_METRICS = frozenset({"tokens", "seqs", "tokens_pos", "tokens_neg", "pg_loss", "kl_loss", "echo_tokens"})
MAXED_METRICS = frozenset({"ratio_max"})


def _denominator(key: str) -> str | None:
    if key.startswith("gate_frac_lag"):
        return "tokens_lag" + key[len("gate_frac_lag"):]
    return METRIC_DENOMINATORS.get(key)


def combine_metrics(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Merge the diagnostics of the micro-batches of one step into whole-batch values.

    Counts and loss parts are summed, ``ratio_max`` is maxed, fractions and means are weighted by
    their denominators (``tokens``, ``tokens_pos``, ``seqs``, ``tokens_lag{k}``, ...).

    Args:
        parts: the metric dicts returned by ``Algorithm.loss`` for each micro-batch.
    """
    out: dict[str, float] = {}
    keys: list[str] = []
    for p in parts:
        keys.extend(k for k in p if k not in keys)
    for k in keys:
        vals = [(p, float(p[k])) for p in parts if k in p]
        if k in SUMMED_METRICS or k.startswith("tokens_lag"):
            out[k] = sum(v for _, v in vals)
        elif k in MAXED_METRICS:
            out[k] = max(v for _, v in vals)
        else:
            den = _denominator(k)
            if den is None:
                out[k] = sum(v for _, v in vals) / len(vals)
                continue
            w = [float(p.get(den, 0.0)) for p, _ in vals]
            total = sum(w)
            out[k] = sum(wi * v for wi, (_, v) in zip(w, vals, strict=True)) / total if total > 0 else 0.0
    return out
