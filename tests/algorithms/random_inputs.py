"""Random micro-batch inputs (logits, tokens, behaviour, reference, advantages, ragged mask; multi-turn roles)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .golden import ref_logsoftmax
from .runners import Extras

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
    # multi-turn (MULTI_TURN): action/echo/masked roles, NaN behaviour and reference off the actions
    "grpo_echo": {"name": "grpo", "kl_beta": 0.05, "echo_alpha": 0.3},
    "gigpo_echo": {"name": "gigpo", "kl_beta": 0.05, "echo_alpha": 0.7, "gigpo_omega": 0.6},
    "dapo_echo_taper": {"name": "dapo", "max_tokens": 8, "echo_alpha": 0.5, "echo_schedule": "linear_taper_to_zero"},
    "gspo_echo": {"name": "gspo", "kl_beta": 0.05, "echo_alpha": 0.2, "gspo_eps_low": 0.05, "gspo_eps_high": 0.05},
    "cispo_echo": {"name": "cispo", "kl_beta": 0.05, "echo_alpha": 1.5},
}
MULTI_TURN = frozenset(k for k in CONFIGS if "echo" in k)
TOKEN_ADVANTAGES = frozenset({"gigpo_echo"})


@dataclass
class Batch:
    logits: np.ndarray
    tokens: np.ndarray
    behaviour: np.ndarray
    ref: np.ndarray
    adv: np.ndarray
    mask: np.ndarray
    lag: np.ndarray
    extras: Extras | None = None


def random_batch(seed: int, b: int = 6, t: int = 8, v: int = 7, temperature: float = 1.0, multi_turn: bool = False,
                 token_advantages: bool = False, echo_alpha: float | None = None) -> Batch:
    """Random inputs; ``multi_turn`` turns each row into actions, echo and masked observation tokens.

    Args:
        seed: the rng seed.
        b: rows.
        t: tokens per row.
        v: vocabulary.
        temperature: the logprob temperature.
        multi_turn: draw roles (the same draws as without it come first, so single-turn data is unchanged).
        token_advantages: also draw per-token advantages (GiGPO's).
        echo_alpha: ``LossInputs.echo_alpha`` to pass (None: the config's).
    """
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
    if not multi_turn:
        return Batch(logits, tokens, behaviour, ref, adv, mask, lag)
    roles = rng.choice(3, size=(b, t), p=[0.25, 0.45, 0.3]) * mask  # 0 masked, 1 action, 2 echo; padding 0
    roles[:, 0] = 1
    action = (roles == 1).astype(np.float64)
    echo = (roles == 2).astype(np.float64)
    behaviour[action == 0] = np.nan
    ref[action == 0] = np.nan
    tok_adv = adv[:, None] + rng.normal(0.0, 0.5, (b, t)) if token_advantages else None
    hits = rng.integers(0, 2, (b, t)).astype(np.float64)
    extras = Extras(tok_adv, echo, max(1.0, float(echo.sum())), echo_alpha, hits)
    return Batch(logits, tokens, behaviour, ref, adv, action, lag, extras)
