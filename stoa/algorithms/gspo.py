"""GSPO (arXiv 2507.18071): a length-normalised sequence ratio, clipped per sequence."""

# Departs from the paper: the ratio's "old" policy is the worker-recorded behaviour logprob; an
# optional KL term (per-sequence token mean, then mean over sequences) and optional sequence-level
# dual-clip and truncated IS are available (off in the preset); the token gate is rejected (GSPO
# clips whole sequences); the GSPO-token variant is not implemented.

from __future__ import annotations

from typing import Any

from stoa.algorithms import core
from stoa.algorithms.base import LossInputs
from stoa.algorithms.bases import BaseAlgorithm


class GSPO(BaseAlgorithm):
    """s_i = exp(mean_t log(pi/mu)); loss_i = -min(s_i A_i, clip(s_i, 1-eps_l, 1+eps_h) A_i), mean over i."""

    name = "gspo"
    reduction = "seq_mean"

    def loss(self, inp: LossInputs[Any]) -> tuple[Any, dict[str, float]]:
        """Scalar loss share of this micro-batch and its diagnostics.

        Args:
            inp: the micro-batch (``normalizer`` from ``self.normalizer`` on the whole batch).
        """
        self._check(inp)
        if inp.token_advantages is not None:
            raise ValueError("token_advantages: gspo clips a sequence ratio and takes per-sequence advantages only")
        c, ops = self.cfg, self.ops
        sg = ops.stop_gradient
        mask, logp, blogp = self._masked_inputs(inp)
        adv = ops.f32(inp.advantages)
        lr = core.log_ratio(ops, logp, blogp, mask)
        lengths = ops.sum(mask, axis=1)
        seq_lr = ops.clip(ops.sum(lr * mask, axis=1) / ops.clip(lengths, 1.0, None),
                          -core.LOG_RATIO_BOUND, core.LOG_RATIO_BOUND)
        s = ops.exp(seq_lr)
        per_seq = core.clipped_surrogate(ops, s, adv, c.gspo_eps_low, c.gspo_eps_high, c.dual_clip_c)
        if c.tis_cap is not None:
            per_seq = per_seq * core.truncation_weight(ops, seq_lr, c.tis_cap)
        pg_loss = core.reduce_seqs(ops, per_seq, mask, inp.normalizer)
        kl_loss, _, kl_sum = self._kl(inp, logp, mask, "seq_mean")
        total = pg_loss if kl_loss is None else pg_loss + kl_loss
        echo = self._echo(inp)
        if echo is not None and echo.loss is not None:
            total = total + echo.loss

        has = ops.f32(lengths > 0)
        reg = core.clip_regimes(ops, s, adv, c.gspo_eps_low, c.gspo_eps_high, c.dual_clip_c)
        r = sg(ops.exp(lr))
        sums: dict[str, Any] = {
            "tokens": ops.sum(mask),
            "seqs": ops.sum(has),
            "seq_clip_frac_low": ops.sum(reg["clip_low"] * has),
            "seq_clip_frac_high": ops.sum(reg["clip_high"] * has),
            "seq_dual_clip_frac": ops.sum(reg["dual_clip"] * has),
            "seq_ratio_mean": ops.sum(sg(s) * has),
            "ratio_mean": ops.sum(r * mask),
            "entropy_proxy": -ops.sum(sg(logp)),
        }
        if c.tis_cap is not None:
            sums["seq_tis_frac"] = ops.sum(ops.f32(sg(s) > c.tis_cap) * has)
        if kl_sum is not None:
            sums["kl"] = kl_sum
        if echo is not None:
            sums.update(echo.sums)
        values = {"pg_loss": sg(pg_loss)}
        if kl_loss is not None:
            values["kl_loss"] = sg(kl_loss)
        maxes = {"ratio_max": ops.max(ops.where(mask > 0, r, 0.0))}
        return total, core.diagnostics(ops, sums=sums, maxes=maxes, values=values)
