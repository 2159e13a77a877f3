"""Random micro-batch inputs (logits, tokens, behaviour, reference, advantages, ragged mask)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .golden import ref_logsoftmax

# One config per algorithm plus option combinations; kl_beta > 0 so the reference path runs.
CONFIGS: dict[str, dict] = {
    "grpo": {"name": "grpo", "kl_beta": 0.05},
    "grpo_kl_gate_tis": {"name": "grpo", "gate": "kl", "tis_cap": 1.3, "kl_beta": 0.05, "kl_estimator": "k2"},
    "grpo_pure_dppo": {"name": "grpo", "eps_low": 1.0, "eps_high": float("inf"), "dual_clip_c": None,
                       "kl_beta": 0.05, "kl_estimator": "k1"},
    "dr_grpo": {"name": "dr_grpo", "kl_beta": 0.05, "max_tokens": 8},
    "dapo": {"name": "dapo", "max_tokens": 8, "overlong_buffer": 3},
    "gspo": {"name": "gspo", "kl_beta": 0.05, "gspo_eps_low": 0.05, "gspo_eps_high": 0.05},
    "gspo_dual_tis": {"name": "gspo", "kl_beta": 0.05, "dual_clip_c": 1.5, "tis_cap": 1.2},
    "rloo": {"name": "rloo", "kl_beta": 0.05, "temperature": 0.8},
    "cispo": {"name": "cispo", "kl_beta": 0.05, "cispo_eps_high": 0.3},
    "cispo_gate": {"name": "cispo", "kl_beta": 0.05, "gate": "tv", "gate_delta_low": 0.05, "gate_delta_high": 0.05},
}


@dataclass
class Batch:
    logits: np.ndarray
    tokens: np.ndarray
    behaviour: np.ndarray
    ref: np.ndarray
    adv: np.ndarray
    mask: np.ndarray
    lag: np.ndarray


def random_batch(seed: int, b: int = 6, t: int = 8, v: int = 7, temperature: float = 1.0) -> Batch:
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 1.5, (b, t, v))
    tokens = rng.integers(0, v, (b, t))
    logp = np.take_along_axis(ref_logsoftmax(logits, temperature), tokens[..., None], axis=-1)[..., 0]
    lengths = rng.integers(1, t + 1, b)
    lengths[0] = t
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)
    behaviour = np.minimum(logp + rng.normal(0.0, 0.6, (b, t)), -1e-3)
    behaviour[mask == 0] = np.nan
    ref = logp + rng.normal(0.0, 0.2, (b, t))
    adv = rng.normal(0.0, 1.0, b)
    lag = rng.integers(0, 3, b)
    return Batch(logits, tokens, behaviour, ref, adv, mask, lag)
