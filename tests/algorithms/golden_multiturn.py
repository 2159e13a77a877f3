"""Golden multi-turn cases (GiGPO, ECHO) on the golden table's logits, worked out by hand.

Rows are episodes of 3 tokens with roles A (action), E (echo) and M (masked observation). The behaviour and
reference logprobs of every non-action token are NaN: a loss that read them would turn NaN. Nothing here
calls stoa; the cases join the golden table (``golden.CASES``) in ``test_golden.py``.
"""

from __future__ import annotations

import math

import numpy as np

from .golden import A_100, LEN3, LOGITS, LOGP, NAN, R100, TOKENS, Case, a0, a1, a2, from_ratio, sampled

# Roles: row 0 = A E A, row 1 = A M A, row 2 = A A A (gigpo) or A E A (echo cases).
GIGPO_MASK = np.array([[1, 0, 1], [1, 0, 1], [1, 1, 1.0]])
GIGPO_ECHO = np.array([[0, 1, 0], [0, 0, 0], [0, 0, 0.0]])
GIGPO_TURNS = np.array([[0, -1, 1], [0, -1, 1], [0, 0, 0]])
GIGPO_STATES = [("s0", "x"), ("s0", "x"), ("s0",)]


def gigpo() -> Case:
    # gamma 0.5, omega 0.5, rewards (1, 0, 0). Turn returns gamma^(K-1-t) R: row 0 (0.5, 1), row 1 (0, 0),
    # row 2 (0). Anchor "s0" = {0.5, 0, 0}: mean 1/6, population std sqrt(1/18); anchor "x" = {1, 0}: mean
    # 1/2, std 1/2. Step advantages: s0 -> (1/3, -1/6, -1/6) / (sqrt(1/18) + 1e-6); x -> +-0.5 / (0.5 + 1e-6).
    s0, sx = math.sqrt(1 / 18) + 1e-6, 0.5 + 1e-6
    w = 0.5
    t00, t02 = a0 + w * (1 / 3) / s0, a0 + w * 0.5 / sx
    t10, t12 = a1 + w * (-1 / 6) / s0, a1 - w * 0.5 / sx
    t2 = a2 + w * (-1 / 6) / s0
    tok_adv = np.array([[t00, a0, t02], [t10, a1, t12], [t2, t2, t2]])
    r = np.array([[1.1, 1.0, 1.3], [0.7, 1.0, 1.1], [0.9, 1.05, 1.0]])
    b = from_ratio(r)
    b[0, 1] = b[1, 1] = NAN
    # row 0 (A>0): free, -, clipped high at 1.2; row 1 (A<0): clipped low at 0.8, -, free; row 2 (A<0): free.
    loss_tok = np.array([[-1.1 * t00, 0, -1.2 * t02], [-0.8 * t10, 0, -1.1 * t12], [-0.9 * t2, -1.05 * t2, -t2]])
    g_tok = np.array([[-1.1 * t00, 0, 0], [0, 0, -1.1 * t12], [-0.9 * t2, -1.05 * t2, -t2]])
    wts = np.array([[1 / 6, 0, 1 / 6], [1 / 6, 0, 1 / 6], [1 / 9] * 3])
    # The echo token (0, 1) is there with echo_alpha 0: no loss, no gradient, but loss_echo is reported.
    return Case("gigpo", {"name": "gigpo", "gate": "none", "kl_beta": 0.0, "gigpo_gamma": 0.5, "gigpo_omega": w},
                b, A_100, float((loss_tok * wts).sum()), g_tok * wts, R100, np.array([[2, 2, 3]]), mask=GIGPO_MASK,
                token_advantages=tok_adv, echo_mask=GIGPO_ECHO, turns=GIGPO_TURNS, states=GIGPO_STATES,
                metrics={"tokens": 7, "tokens_pos": 2, "tokens_neg": 5, "clip_frac_high": 1 / 7,
                         "clip_frac_low": 1 / 7, "echo_tokens": 1, "loss_echo": -float(LOGP[0, 1])})


# Echo cases: rows A E A, A M A, A E A; token (2, 1) is not the argmax of its logits (4), so echo_acc = 1/2.
ECHO_TOKENS = TOKENS.copy()
ECHO_TOKENS[2, 1] = 3
LOGP_E = sampled(LOGITS, ECHO_TOKENS)
ECHO_ACTIONS = np.array([[1, 0, 1], [1, 0, 1], [1, 0, 1.0]])
ECHO_MASK = np.array([[0, 1, 0], [0, 0, 0], [0, 1, 0.0]])
ECHO_HITS = np.array([[1, 1, 1], [1, 1, 1], [1, 0, 1.0]])  # argmax of LOGITS == ECHO_TOKENS
ECHO_NLL = -(LOGP_E[0, 1] + LOGP_E[2, 1])  # summed over the 2 echo tokens of the batch
ECHO_D = np.array([[0.3, 0.0, 0.1], [0.5, 0.0, 0.0], [0.2, 0.0, -0.1]])  # logp - ref_logp on actions


def _off_actions_nan(x: np.ndarray) -> np.ndarray:
    out = x.copy()
    out[ECHO_ACTIONS == 0] = NAN
    return out


def echo_grpo_kl() -> Case:
    # r = 1 on actions (loss -A, d/dlogp -A), k3 KL with beta 0.1 on actions only, weights 1 / (2 tokens * 3 rows);
    # echo: alpha 0.5 (the config's, constant) * NLL / 2 echo tokens, d/dlogp = -0.5 / 2 on each echo token.
    alpha, beta = 0.5, 0.1
    k, gk = np.exp(-ECHO_D) + ECHO_D - 1, 1 - np.exp(-ECHO_D)
    adv = A_100[:, None]
    w = ECHO_ACTIONS / 6
    loss = float((w * (-adv + beta * k)).sum()) + alpha * ECHO_NLL / 2
    dlogp = w * (-adv + beta * gk) - alpha / 2 * ECHO_MASK
    return Case("echo_grpo_kl", {"name": "grpo", "gate": "none", "kl_beta": beta, "echo_alpha": alpha},
                _off_actions_nan(LOGP_E), A_100, loss, dlogp, R100, LEN3, mask=ECHO_ACTIONS,
                ref_logp=_off_actions_nan(LOGP_E - ECHO_D), tokens=ECHO_TOKENS, echo_mask=ECHO_MASK,
                echo_hits=ECHO_HITS,
                metrics={"tokens": 6, "echo_tokens": 2, "loss_echo": ECHO_NLL / 2, "echo_acc": 0.5,
                         "kl": float((k * ECHO_ACTIONS).sum()) / 6, "pg_loss": float((w * -adv).sum())})


def echo_taper_cispo() -> Case:
    # CISPO with r = 1: loss -A logp, d/dlogp -A, token mean over the 6 action tokens. The taper's coefficient at
    # step 1 of 4 is 0.5 * (1 - 1/4) = 0.375, passed as LossInputs.echo_alpha.
    coef = 0.375
    adv = A_100[:, None]
    loss = float((-adv * LOGP_E * ECHO_ACTIONS).sum()) / 6 + coef * ECHO_NLL / 2
    dlogp = -adv * ECHO_ACTIONS / 6 - coef / 2 * ECHO_MASK
    return Case("echo_taper_cispo", {"name": "cispo", "kl_beta": 0.0, "echo_alpha": 0.5,
                                     "echo_schedule": "linear_taper_to_zero"},
                _off_actions_nan(LOGP_E), A_100, loss, dlogp, R100, LEN3, mask=ECHO_ACTIONS, tokens=ECHO_TOKENS,
                echo_mask=ECHO_MASK, echo_hits=ECHO_HITS, echo_alpha=coef,
                metrics={"tokens": 6, "echo_tokens": 2, "loss_echo": ECHO_NLL / 2, "echo_acc": 0.5})


MULTI_TURN_CASES: list[Case] = [gigpo(), echo_grpo_kl(), echo_taper_cispo()]
