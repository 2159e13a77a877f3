"""Golden cases: losses, logit gradients and advantages worked out by hand on a 5-token vocabulary.

Every case fixes logits [3, 3, 5], sampled tokens and the behaviour policy (as a ratio r = p / mu, a
behaviour probability mu, or a log-ratio), then writes the expected per-token loss and per-token
d(loss)/d(logp) regime by regime (free, clipped, dual-clipped, gated, truncated) with the
reduction weights spelled out. The only numerics shared with the inputs are a numpy log-softmax
(for p and logp) and the chain rule d logp / d logits = (onehot - softmax) / temperature. Nothing
here calls stoa.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

LOGITS = np.array(
    [
        [[2.0, 0.5, -1.0, 0.0, 0.3], [0.1, 1.5, 0.2, -0.5, 0.0], [1.0, 1.0, 3.0, 0.0, -2.0]],
        [[0.0, 0.0, 0.0, 2.5, 0.0], [1.2, -0.3, 0.4, 0.0, 0.9], [0.5, 2.2, -1.0, 0.3, 0.0]],
        [[-1.0, 0.0, 1.8, 0.2, 0.6], [0.3, 0.3, 0.3, 0.3, 2.0], [2.4, 0.0, 0.1, -0.2, 0.5]],
    ]
)
TOKENS = np.array([[0, 1, 2], [3, 0, 1], [2, 4, 0]])
FULL = np.ones((3, 3))
NAN = float("nan")  # behaviour logprob on padding: must never leak into loss or gradient

# GRPO advantages of one group with rewards (1, 0, 0): mean 1/3, population std sqrt(2)/3, +1e-6.
STD_100 = math.sqrt(2) / 3 + 1e-6
A_100 = np.array([2 / 3, -1 / 3, -1 / 3]) / STD_100
a0, a1, a2 = A_100


def ref_logsoftmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    z = logits / temperature
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def sampled(logits: np.ndarray, tokens: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """log p of the sampled tokens (float64)."""
    return np.take_along_axis(ref_logsoftmax(logits, temperature), tokens[..., None], axis=-1)[..., 0]


def logit_grad(dlogp: np.ndarray, logits: np.ndarray, tokens: np.ndarray, temperature: float) -> np.ndarray:
    """Chain rule through log_softmax(logits / tau)[token]: dlogp * (onehot - softmax) / tau."""
    probs = np.exp(ref_logsoftmax(logits, temperature))
    onehot = np.eye(logits.shape[-1])[tokens]
    return dlogp[..., None] * (onehot - probs) / temperature


def seq_token_mean_weights(mask: np.ndarray) -> np.ndarray:
    """GRPO weights: 1 / (tokens of the row * number of rows)."""
    return mask / mask.sum(axis=1, keepdims=True) / mask.shape[0]


@dataclass
class Case:
    name: str
    cfg: dict[str, Any]
    behaviour_logp: np.ndarray
    advantages: np.ndarray  # fed into the loss, and expected from rewards/lengths
    loss: float
    dlogp: np.ndarray
    rewards: np.ndarray
    lengths: np.ndarray
    mask: np.ndarray = field(default_factory=lambda: FULL.copy())
    ref_logp: np.ndarray | None = None
    temperature: float = 1.0
    metrics: dict[str, float] = field(default_factory=dict)
    version_lag: np.ndarray | None = None
    tokens: np.ndarray = field(default_factory=lambda: TOKENS.copy())
    # multi-turn inputs (golden_multiturn.py): per-token advantages (fed, and expected from the trajectories'
    # turns and anchor states), the echo mask, argmax hits, and the ECHO coefficient (None: the config's).
    token_advantages: np.ndarray | None = None
    echo_mask: np.ndarray | None = None
    echo_hits: np.ndarray | None = None
    echo_alpha: float | None = None
    turns: np.ndarray | None = None
    states: list[tuple[str, ...]] | None = None

    @property
    def grad_logits(self) -> np.ndarray:
        return logit_grad(self.dlogp, LOGITS, self.tokens, self.temperature)


LOGP = sampled(LOGITS, TOKENS)
P = np.exp(LOGP)  # [[.6286, .5326, .7535], [.7528, .3684, .6739], [.5783, .5778, .7068]]
R100 = np.array([[1.0, 0.0, 0.0]])
LEN3 = np.array([[3, 3, 3]])


def from_ratio(r: np.ndarray, logp: np.ndarray = LOGP) -> np.ndarray:
    return logp - np.log(r)


def grpo_clip() -> Case:
    r = np.array([[1.1, 1.5, 0.7], [0.7, 1.1, 5.0], [1.3, 0.9, 0.85]])
    mask = np.array([[1, 1, 1], [1, 1, 0], [1, 1, 1.0]])
    b = from_ratio(r)
    b[1, 2] = NAN
    # row 0 (A>0): free, clipped at 1.2, free (low side open for A>0); row 1 (A<0): clipped at 0.8,
    # free, padding; row 2 (A<0): all free.
    loss_tok = np.array([[-1.1 * a0, -1.2 * a0, -0.7 * a0], [-0.8 * a1, -1.1 * a1, 0],
                         [-1.3 * a2, -0.9 * a2, -0.85 * a2]])
    g_tok = np.array([[-1.1 * a0, 0, -0.7 * a0], [0, -1.1 * a1, 0], [-1.3 * a2, -0.9 * a2, -0.85 * a2]])
    loss = (loss_tok[0].sum() / 3 + loss_tok[1].sum() / 2 + loss_tok[2].sum() / 3) / 3
    w = np.array([[1 / 9] * 3, [1 / 6, 1 / 6, 0], [1 / 9] * 3])
    return Case("grpo_clip", {"name": "grpo", "gate": "none", "kl_beta": 0.0}, b, A_100, loss, g_tok * w,
                R100, LEN3, mask=mask,
                metrics={"tokens": 8, "seqs": 3, "clip_frac_high": 1 / 8, "clip_frac_low": 1 / 8,
                         "dual_clip_frac": 0.0, "ratio_mean": (1.1 + 1.5 + 0.7 + 0.7 + 1.1 + 1.3 + 0.9 + 0.85) / 8,
                         "ratio_max": 1.5, "entropy_proxy": -float((LOGP * mask).sum()) / 8})


DUAL_R = np.array([[4.0, 1.0, 0.9], [4.0, 2.5, 0.5], [3.5, 1.0, 0.75]])


def grpo_dual_clip() -> Case:
    # A>0 with r=4: plain upper clip (-1.2 A); A<0 with r=4 and 3.5: loss capped at 3|A| (dual clip);
    # A<0 with r=2.5 < c: free; A<0 with r < 0.8: lower clip.
    loss_tok = np.array([[-1.2 * a0, -1.0 * a0, -0.9 * a0], [-3 * a1, -2.5 * a1, -0.8 * a1],
                         [-3 * a2, -1.0 * a2, -0.8 * a2]])
    g_tok = np.array([[0, -1.0 * a0, -0.9 * a0], [0, -2.5 * a1, 0], [0, -1.0 * a2, 0]])
    return Case("grpo_dual_clip", {"name": "grpo", "gate": "none", "kl_beta": 0.0}, from_ratio(DUAL_R), A_100,
                loss_tok.sum() / 9, g_tok / 9, R100, LEN3,
                metrics={"dual_clip_frac": 2 / 9, "clip_frac_high": 1 / 9, "clip_frac_low": 2 / 9, "ratio_max": 4.0})


def grpo_no_dual() -> Case:
    # Same data without the dual clip: the A<0 tokens at r=4 and 3.5 are free (loss r|A|).
    loss_tok = np.array([[-1.2 * a0, -1.0 * a0, -0.9 * a0], [-4 * a1, -2.5 * a1, -0.8 * a1],
                         [-3.5 * a2, -1.0 * a2, -0.8 * a2]])
    g_tok = np.array([[0, -1.0 * a0, -0.9 * a0], [-4 * a1, -2.5 * a1, 0], [-3.5 * a2, -1.0 * a2, 0]])
    return Case("grpo_no_dual", {"name": "grpo", "gate": "none", "kl_beta": 0.0, "dual_clip_c": None},
                from_ratio(DUAL_R), A_100, loss_tok.sum() / 9, g_tok / 9, R100, LEN3,
                metrics={"dual_clip_frac": 0.0})


# Behaviour probabilities for the gate cases. Row 0 has A>0, rows 1 and 2 have A<0.
GATE_MU = np.array([[0.45, 0.38, 0.65], [0.89, 0.20, 0.75], [0.50, 0.74, 0.70]])
GATE_R = P / GATE_MU


def bernoulli_kl(mu: float, p: float) -> float:
    return mu * math.log(mu / p) + (1 - mu) * math.log((1 - mu) / (1 - p))


def _check_gate_data() -> None:
    p, mu = P, GATE_MU
    # binary TV |p - mu| against 0.15, in the direction the advantage pushes:
    assert p[0, 0] - mu[0, 0] > 0.15 and p[0, 1] - mu[0, 1] > 0.15  # A>0, rose: dropped
    assert 0 < p[0, 2] - mu[0, 2] < 0.15  # A>0, rose a little: kept
    assert 0 < mu[1, 0] - p[1, 0] < 0.15 and mu[2, 1] - p[2, 1] > 0.15  # A<0, fell: kept / dropped
    assert p[1, 1] > mu[1, 1] and p[2, 0] > mu[2, 0] and p[2, 2] > mu[2, 2]  # A<0, rose: never dropped
    # binary KL against 0.05:
    assert bernoulli_kl(mu[0, 0], p[0, 0]) > 0.05 and bernoulli_kl(mu[0, 1], p[0, 1]) < 0.05
    assert bernoulli_kl(mu[0, 2], p[0, 2]) < 0.05
    assert bernoulli_kl(mu[1, 0], p[1, 0]) > 0.05 and bernoulli_kl(mu[2, 1], p[2, 1]) > 0.05
    assert bernoulli_kl(mu[1, 2], p[1, 2]) < 0.05


_check_gate_data()
PURE = {"eps_low": 1.0, "eps_high": math.inf, "dual_clip_c": None, "kl_beta": 0.0}


def _gated_case(name: str, cfg: dict[str, Any], dropped: list[tuple[int, int]], cispo: bool = False,
                **kw: Any) -> Case:
    keep = np.ones((3, 3))
    for i, j in dropped:
        keep[i, j] = 0.0
    adv = A_100[:, None]
    if cispo:  # -stop_grad(min(r, 5)) A logp; every r here is below 5
        loss_tok, g_tok = -GATE_R * adv * LOGP * keep, -GATE_R * adv * keep
        w = np.full((3, 3), 1 / 9)
    else:  # no ratio clip: free tokens have loss -r A and d/dlogp -r A
        loss_tok = g_tok = -GATE_R * adv * keep
        w = seq_token_mean_weights(FULL)
    return Case(name, cfg, np.log(GATE_MU), A_100, float((loss_tok * w).sum()), g_tok * w, R100, LEN3, **kw)


def gate_tv() -> Case:
    return _gated_case("gate_tv_pure", {"name": "grpo", "gate": "tv", **PURE}, [(0, 0), (0, 1), (2, 1)],
                       version_lag=np.array([0, 1, 1]),
                       metrics={"gate_frac": 3 / 9, "gate_frac_pos": 2 / 3, "gate_frac_neg": 1 / 6,
                                "tokens_pos": 3, "tokens_neg": 6, "tokens_lag0": 3, "gate_frac_lag0": 2 / 3,
                                "tokens_lag1": 6, "gate_frac_lag1": 1 / 6,
                                "clip_frac_low": 0.0, "clip_frac_high": 0.0})


def gate_kl() -> Case:
    return _gated_case("gate_kl_pure", {"name": "grpo", "gate": "kl", **PURE}, [(0, 0), (1, 0), (2, 1)],
                       metrics={"gate_frac_pos": 1 / 3, "gate_frac_neg": 2 / 6})


def gate_tv_custom_deltas() -> Case:
    # delta_high 0.2 keeps (0, 0) and (0, 1) (they rose by 0.179 and 0.153); delta_low 0.1 drops
    # (1, 0) (fell by 0.137) and (2, 1) (fell by 0.162) but keeps (1, 2) (fell by 0.076).
    assert P[0, 0] - GATE_MU[0, 0] < 0.2 and GATE_MU[1, 0] - P[1, 0] > 0.1 and GATE_MU[1, 2] - P[1, 2] < 0.1
    return _gated_case("gate_tv_deltas", {"name": "grpo", "gate": "tv", "gate_delta_low": 0.1,
                                          "gate_delta_high": 0.2, **PURE}, [(1, 0), (2, 1)],
                       metrics={"gate_frac_pos": 0.0, "gate_frac_neg": 2 / 6})


def gate_and_clip() -> Case:
    # Defaults: eps 0.2, dual-clip 3, TV gate 0.15.
    r = np.array([[1.5, 1.1, 0.9], [P[1, 0] / 0.92, 0.78, 4.0], [1.0, 1.0, 1.0]])
    assert P[0, 0] * (1 - 1 / 1.5) > 0.15  # (0,0): clipped AND gated -> 0 instead of -1.2 A
    assert P[0, 1] * (1 - 1 / 1.1) < 0.15  # (0,1): free
    assert 0.92 - P[1, 0] > 0.15 and r[1, 0] > 0.8  # (1,0): gated although not clipped
    assert P[1, 1] * (1 / 0.78 - 1) < 0.15  # (1,1): lower clip only
    loss_tok = np.array([[0, -1.1 * a0, -0.9 * a0], [0, -0.8 * a1, -3 * a1], [-a2, -a2, -a2]])
    g_tok = np.array([[0, -1.1 * a0, -0.9 * a0], [0, 0, 0], [-a2, -a2, -a2]])
    return Case("gate_and_clip", {"name": "grpo", "kl_beta": 0.0}, from_ratio(r), A_100, loss_tok.sum() / 9,
                g_tok / 9, R100, LEN3,
                metrics={"gate_frac_pos": 1 / 3, "gate_frac_neg": 1 / 6, "clip_frac_high": 1 / 9,
                         "clip_frac_low": 1 / 9, "dual_clip_frac": 1 / 9})


KL_D = np.array([[0.3, -0.2, 0.1], [0.5, -0.4, 0.0], [0.2, 0.25, -0.1]])  # d = logp - ref_logp
KL_MASK = np.array([[1, 1, 1], [1, 1, 1], [1, 1, 0.0]])


def kl_case(estimator: str) -> Case:
    d = KL_D
    if estimator == "k1":
        k, gk = d, np.ones_like(d)
    elif estimator == "k2":
        k, gk = 0.5 * d**2, d
    else:
        k, gk = np.exp(-d) + d - 1, 1 - np.exp(-d)
    beta = 0.1
    w = np.array([[1 / 9] * 3, [1 / 9] * 3, [1 / 6, 1 / 6, 0]])
    pg = -A_100[:, None] * np.ones((3, 3))  # r = 1 everywhere: loss -A, d/dlogp -A
    loss = float((w * (pg + beta * k)).sum())
    return Case(f"kl_{estimator}", {"name": "grpo", "gate": "none", "kl_beta": beta, "kl_estimator": estimator},
                LOGP.copy(), A_100, loss, w * (pg + beta * gk), R100, LEN3, mask=KL_MASK, ref_logp=LOGP - d,
                metrics={"kl": float((k * KL_MASK).sum()) / 8})


def tis() -> Case:
    r = np.array([[1.1, 1.6, 0.9], [2.0, 1.2, 0.5], [1.0, 1.0, 1.0]])
    # cap 1.5, no dual clip: (1,0) A<0 r=2 free -> weight truncated to 1.5; (0,1) clipped at 1.2 and
    # r>cap -> value scaled by 1.5/1.6, no gradient; everything below the cap is untouched.
    loss_tok = np.array([[-1.1 * a0, -1.2 * a0 * 1.5 / 1.6, -0.9 * a0], [-1.5 * a1, -1.2 * a1, -0.8 * a1],
                         [-a2, -a2, -a2]])
    g_tok = np.array([[-1.1 * a0, 0, -0.9 * a0], [-1.5 * a1, -1.2 * a1, 0], [-a2, -a2, -a2]])
    return Case("tis", {"name": "grpo", "gate": "none", "kl_beta": 0.0, "dual_clip_c": None, "tis_cap": 1.5},
                from_ratio(r), A_100, loss_tok.sum() / 9, g_tok / 9, R100, LEN3, metrics={"tis_frac": 2 / 9})


def temperature() -> Case:
    tau = 0.7
    logp = sampled(LOGITS, TOKENS, tau)
    r = np.array([[1.0, 1.1, 0.95], [1.05, 0.9, 1.0], [1.0, 1.0, 1.0]])
    loss_tok = g_tok = -r * A_100[:, None]
    return Case("temperature", {"name": "grpo", "gate": "none", "kl_beta": 0.0, "temperature": tau},
                from_ratio(r, logp), A_100, loss_tok.sum() / 9, g_tok / 9, R100, LEN3, temperature=tau)


def dr_grpo() -> Case:
    adv = np.array([2 / 3, -1 / 3, -1 / 3])  # r - mean, no std
    b0, b1, b2 = adv
    mask = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0.0]])
    r = np.array([[1.05, 1.3, 0.9], [0.95, 1.1, 1.0], [1.02, 1.0, 1.0]])
    assert P[0, 1] * (1 - 1 / 1.3) < 0.15 and P[1, 0] * (1 / 0.95 - 1) < 0.15  # default TV gate idle
    loss_tok = np.array([[-1.05 * b0, -1.2 * b0, -0.9 * b0], [-0.95 * b1, -1.1 * b1, 0], [-1.02 * b2, 0, 0]])
    g_tok = np.array([[-1.05 * b0, 0, -0.9 * b0], [-0.95 * b1, -1.1 * b1, 0], [-1.02 * b2, 0, 0]])
    # constant normaliser: 3 sequences * max_tokens 4
    return Case("dr_grpo", {"name": "dr_grpo", "kl_beta": 0.0, "max_tokens": 4}, from_ratio(r), adv,
                loss_tok.sum() / 12, g_tok / 12, R100, LEN3, mask=mask)


def dapo() -> Case:
    # rewards (1, 1, 0), lengths (1, 2, 3), max_tokens 3, buffer 2: ramp starts after length 1,
    # so the shaped rewards are (1, 1 - 0.5, 0 - 1) = (1, 0.5, -1); mean 1/6.
    dev = np.array([5 / 6, 2 / 6, -7 / 6])
    adv = dev / (math.sqrt((25 + 4 + 49) / 36 / 3) + 1e-6)
    c0, c1, c2 = adv
    mask = np.array([[1, 0, 0], [1, 1, 0], [1, 1, 1.0]])
    r = np.array([[1.25, 1.0, 1.0], [1.1, 1.3, 1.0], [1.1, 0.85, 0.75]])
    b = from_ratio(r)
    b[0, 1:] = NAN
    b[1, 2] = NAN
    assert P[0, 0] * (1 - 1 / 1.25) < 0.15 and P[1, 1] * (1 - 1 / 1.3) < 0.15  # not gated
    assert P[2, 1] * (1 / 0.85 - 1) < 0.15 and P[2, 2] * (1 / 0.75 - 1) > 0.15  # (2,2) gated
    # clip-higher: (0,0) r=1.25 < 1.28 is free; (1,1) r=1.3 clipped at 1.28.
    loss_tok = np.array([[-1.25 * c0, 0, 0], [-1.1 * c1, -1.28 * c1, 0], [-1.1 * c2, -0.85 * c2, 0]])
    g_tok = np.array([[-1.25 * c0, 0, 0], [-1.1 * c1, 0, 0], [-1.1 * c2, -0.85 * c2, 0]])
    return Case("dapo", {"name": "dapo", "max_tokens": 3, "overlong_buffer": 2}, b, adv, loss_tok.sum() / 6,
                g_tok / 6, np.array([[1.0, 1.0, 0.0]]), np.array([[1, 2, 3]]), mask=mask,
                metrics={"clip_frac_high": 1 / 6, "gate_frac_neg": 1 / 3, "tokens": 6})


def gspo() -> Case:
    lr = np.array([[2e-4, -1e-4, 2e-4], [-1e-3, -1e-3, 0.0], [1e-4, 3e-4, 2e-4]])
    mask = np.array([[1, 1, 1], [1, 1, 0], [1, 1, 1.0]])
    b = LOGP - lr
    b[1, 2] = NAN
    s0, s2 = math.exp(1e-4), math.exp(2e-4)  # inside [1 - 3e-4, 1 + 4e-4]: free
    # row 1: s = exp(-1e-3) < 1 - 3e-4 with A<0: clipped, loss -(1 - 3e-4) A, no gradient.
    pg = (-s0 * a0 - (1 - 3e-4) * a1 - s2 * a2) / 3
    g_pg = np.array([[-s0 * a0 / 3] * 3, [0, 0, 0], [-s2 * a2 / 3] * 3]) / 3  # ds/dlogp_t = s / L
    beta, d = 0.1, np.array([[0.1, 0.1, 0.1], [0.2, 0.2, 0.0], [0.0, -0.1, 0.1]])
    k3, gk3 = np.exp(-d) + d - 1, 1 - np.exp(-d)
    w = seq_token_mean_weights(mask)
    loss = pg + beta * float((w * k3).sum())
    return Case("gspo", {"name": "gspo", "kl_beta": beta}, b, A_100, loss, g_pg + beta * w * gk3, R100, LEN3,
                mask=mask, ref_logp=LOGP - d,
                metrics={"seq_clip_frac_low": 1 / 3, "seq_clip_frac_high": 0.0, "seqs": 3,
                         "seq_ratio_mean": (s0 + math.exp(-1e-3) + s2) / 3})


def rloo() -> Case:
    adv = np.array([1.0, -0.5, -0.5])  # 1 - mean(0, 0); 0 - mean(1, 0)
    b0, b1, b2 = adv
    r = np.array([[1.1, 0.9, 1.0], [1.05, 0.75, 1.0], [1.0, 1.0, 0.95]])
    assert P[0, 0] * (1 - 1 / 1.1) < 0.15 and P[1, 1] * (1 / 0.75 - 1) < 0.15  # gate idle
    loss_tok = np.array([[-1.1 * b0, -0.9 * b0, -b0], [-1.05 * b1, -0.8 * b1, -b1], [-b2, -b2, -0.95 * b2]])
    g_tok = np.array([[-1.1 * b0, -0.9 * b0, -b0], [-1.05 * b1, 0, -b1], [-b2, -b2, -0.95 * b2]])
    return Case("rloo", {"name": "rloo", "kl_beta": 0.0}, from_ratio(r), adv, loss_tok.sum() / 9, g_tok / 9,
                R100, LEN3)


def cispo() -> Case:
    r = np.array([[1.5, 3.0, 0.8], [0.8, 2.5, 1.0], [1.0, 1.0, 1.0]])
    mask = np.array([[1, 1, 1], [1, 1, 0], [1, 1, 1.0]])
    wgt = np.array([[1.5, 2.0, 0.8], [0.8, 2.0, 0.0], [1.0, 1.0, 1.0]])  # min(r, 1 + 1.0), padding 0
    adv = A_100[:, None]
    loss_tok, g_tok = -wgt * adv * LOGP, -wgt * adv
    return Case("cispo", {"name": "cispo", "kl_beta": 0.0, "cispo_eps_high": 1.0}, from_ratio(r), A_100,
                float(loss_tok.sum()) / 8, g_tok / 8, R100, LEN3, mask=mask,
                metrics={"clip_frac_high": 2 / 8, "tokens": 8})


def cispo_gate() -> Case:
    return _gated_case("cispo_gate_tv", {"name": "cispo", "kl_beta": 0.0, "gate": "tv"},
                       [(0, 0), (0, 1), (2, 1)], cispo=True, metrics={"gate_frac_pos": 2 / 3})


CASES: list[Case] = [
    grpo_clip(),
    grpo_dual_clip(),
    grpo_no_dual(),
    gate_tv(),
    gate_kl(),
    gate_tv_custom_deltas(),
    gate_and_clip(),
    kl_case("k1"),
    kl_case("k2"),
    kl_case("k3"),
    tis(),
    temperature(),
    dr_grpo(),
    dapo(),
    gspo(),
    rloo(),
    cispo(),
    cispo_gate(),
]
