"""Base classes the concrete algorithms extend: advantages/filter/normaliser, and the token-level PPO loss."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np

from stoa.algorithms import core
from stoa.algorithms.advantages import check_groups, group_advantages, overlong_shaping
from stoa.algorithms.base import AlgoConfig, LossInputs, Reduction, echo_coefficient
from stoa.algorithms.ops import Ops


class EchoTerm(NamedTuple):
    """The ECHO term of one micro-batch: its loss share (None when the coefficient is 0) and metric sums."""

    loss: Any
    sums: dict[str, Any]


class BaseAlgorithm:
    """Shared numpy side of every algorithm; subclasses set ``name``, ``reduction`` and ``loss``.

    Args:
        cfg: the validated config (its ``name`` must match the class).
        ops: the backend shim (``stoa.algorithms.ops.load_ops``).
    """

    name: ClassVar[str] = ""
    reduction: Reduction = "token_mean"

    def __init__(self, cfg: AlgoConfig, ops: Ops):
        if cfg.name != self.name:
            raise ValueError(f"name: config is for {cfg.name!r}, not {self.name!r}")
        self.cfg = cfg.validate()
        self.ops = ops

    def shape_rewards(self, rewards: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Rewards [G, n] after the overlong shaping (unchanged when overlong_buffer is 0).

        Args:
            rewards: [G, n] raw rewards.
            lengths: [G, n] completion lengths in tokens.
        """
        c = self.cfg
        if c.overlong_buffer <= 0:
            return check_groups(rewards, lengths)
        assert c.max_tokens is not None  # validate() guarantees it
        return overlong_shaping(rewards, lengths, c.max_tokens, c.overlong_buffer, c.overlong_penalty)

    def advantages(self, rewards: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Group-relative advantages [G, n] float32 of the shaped rewards.

        Args:
            rewards: [G, n] raw rewards.
            lengths: [G, n] completion lengths in tokens.
        """
        return group_advantages(self.shape_rewards(rewards, lengths), self.cfg.adv_std_norm)

    def turn_advantages(self, rewards: np.ndarray, lengths: np.ndarray,
                        states: Sequence[Sequence[Sequence[str]]]) -> list[list[np.ndarray]] | None:
        """None: the advantage is per sequence (GiGPO overrides this with its step advantages).

        Args:
            rewards: [G, n] raw rewards.
            lengths: [G, n] action-token counts.
            states: [G][n] anchor keys of each trajectory's turns.
        """
        return None

    def echo_coefficient(self, step: int, total_steps: int) -> float:
        """The ECHO coefficient of optimizer step ``step`` under the config's schedule.

        Args:
            step: the step about to be taken (0 for the first).
            total_steps: the run's total steps (used by 'linear_taper_to_zero').
        """
        return echo_coefficient(self.cfg, step, total_steps)

    def keep_groups(self, rewards: np.ndarray) -> np.ndarray:
        """bool [G]: every group is kept.

        Args:
            rewards: [G, n] raw rewards.
        """
        return np.ones(check_groups(rewards).shape[0], dtype=bool)

    def normalizer(self, mask_all: np.ndarray) -> float:
        """The whole batch's loss denominator for this algorithm's reduction.

        Args:
            mask_all: [B, T] mask of the whole optimizer-step batch.
        """
        return core.normalizer_for(self.reduction, mask_all, self.cfg.max_tokens)

    def token_logprobs(self, logits: Any, targets: Any) -> Any:
        """Logprobs [B, T] of ``targets`` under ``logits / cfg.temperature``.

        Args:
            logits: [B, T, V] backend array.
            targets: [B, T] token ids.
        """
        return self.ops.token_logprobs(logits, targets, self.cfg.temperature)

    def token_hits(self, logits: Any, targets: Any) -> Any:
        """0/1 float [B, T]: the logits' argmax equals the target (``LossInputs.echo_hits``), no gradient.

        Args:
            logits: [B, T, V] backend array.
            targets: [B, T] token ids.
        """
        return self.ops.token_hits(logits, targets)

    def _check(self, inp: LossInputs[Any]) -> None:
        shape = tuple(inp.logp.shape)
        if len(shape) != 2:
            raise ValueError(f"logp: expected [B, T], got shape {shape}")
        for f in ("behaviour_logp", "mask", "ref_logp", "token_advantages", "echo_mask", "echo_hits"):
            v = getattr(inp, f)
            if v is not None and tuple(v.shape) != shape:
                raise ValueError(f"{f}: expected shape {shape}, got {tuple(v.shape)}")
        if tuple(inp.advantages.shape) != shape[:1]:
            raise ValueError(f"advantages: expected shape {shape[:1]}, got {tuple(inp.advantages.shape)}")
        if self.cfg.kl_beta > 0 and inp.ref_logp is None:
            raise ValueError("ref_logp: required when kl_beta > 0")
        if not inp.normalizer > 0:
            raise ValueError(f"normalizer: must be > 0, got {inp.normalizer}")
        if not inp.echo_normalizer > 0:
            raise ValueError(f"echo_normalizer: must be > 0, got {inp.echo_normalizer}")
        if inp.echo_alpha is not None and not 0 <= inp.echo_alpha < float("inf"):
            raise ValueError(f"echo_alpha: must be finite and >= 0, got {inp.echo_alpha}")

    def _advantages(self, inp: LossInputs[Any]) -> Any:
        """[B, 1] per-sequence or [B, T] per-token advantages in float32 (``token_advantages`` win)."""
        if inp.token_advantages is not None:
            return self.ops.f32(inp.token_advantages)
        return self.ops.f32(inp.advantages)[:, None]

    def _echo_alpha(self, inp: LossInputs[Any]) -> float:
        """The micro-batch's ECHO coefficient: the given one, else the config's constant one."""
        if inp.echo_alpha is not None:
            return float(inp.echo_alpha)
        if self.cfg.echo_schedule != "constant" and self.cfg.echo_alpha > 0:
            raise ValueError("echo_alpha: the 'linear_taper_to_zero' schedule needs this step's coefficient; "
                             "pass LossInputs(echo_alpha=algo.echo_coefficient(step, total_steps))")
        return float(self.cfg.echo_alpha)

    def _echo(self, inp: LossInputs[Any]) -> EchoTerm | None:
        """The ECHO term: alpha * NLL of the echo tokens / the batch's echo count, on the current policy's
        logprobs only (no ratio, no KL); None without an echo mask. Reports ``loss_echo`` (the unweighted
        NLL mean) and, with ``echo_hits``, ``echo_acc``."""
        if inp.echo_mask is None:
            return None
        ops = self.ops
        em = ops.f32(inp.echo_mask)
        nll = core.echo_nll(ops, ops.f32(inp.logp), em)
        alpha = self._echo_alpha(inp)
        loss = alpha * nll / inp.echo_normalizer if alpha > 0 else None
        sums = {"echo_tokens": ops.sum(em), "loss_echo": ops.stop_gradient(nll)}
        if inp.echo_hits is not None:
            sums["echo_acc"] = ops.sum(ops.stop_gradient(ops.f32(inp.echo_hits)) * em)
        return EchoTerm(loss, sums)

    def _masked_inputs(self, inp: LossInputs[Any]) -> tuple[Any, Any, Any]:
        """(mask, logp, behaviour_logp) in float32 with off-mask entries set to 0 (padding may hold junk)."""
        ops = self.ops
        mask = ops.f32(inp.mask)
        on = mask > 0
        return mask, ops.where(on, ops.f32(inp.logp), 0.0), ops.where(on, ops.f32(inp.behaviour_logp), 0.0)

    def _kl(self, inp: LossInputs[Any], logp: Any, mask: Any, reduction: Reduction) -> tuple[Any, Any, Any]:
        """(kl_loss share or None, per-token KL or None, its detached masked sum or None)."""
        if inp.ref_logp is None:
            return None, None, None
        ops = self.ops
        kl_tok = core.kl_per_token(ops, logp, ops.f32(inp.ref_logp), mask, self.cfg.kl_estimator)
        kl_sum = ops.stop_gradient(ops.sum(kl_tok * mask))
        if self.cfg.kl_beta == 0:
            return None, kl_tok, kl_sum
        kl_loss = self.cfg.kl_beta * core.reduce_tokens(ops, kl_tok, mask, inp.normalizer, reduction)
        return kl_loss, kl_tok, kl_sum


class TokenPolicyAlgorithm(BaseAlgorithm):
    """Token-level loss: clipped (and dual-clipped) PPO surrogate, DPPO gate, TIS and KL, then reduced.

    Subclasses may replace ``_surrogate`` (CISPO) and pick advantages, filter and reduction.
    """

    def _surrogate(self, logp: Any, lr: Any, ratio: Any, adv: Any) -> tuple[Any, dict[str, Any]]:
        """(per-token loss [B, T], 0/1 indicators by metric name) before gate, TIS and reduction."""
        c, ops = self.cfg, self.ops
        loss = core.clipped_surrogate(ops, ratio, adv, c.eps_low, c.eps_high, c.dual_clip_c)
        reg = core.clip_regimes(ops, ratio, adv, c.eps_low, c.eps_high, c.dual_clip_c)
        if c.tis_cap is not None:
            loss = loss * core.truncation_weight(ops, lr, c.tis_cap)
            reg["tis"] = ops.f32(ops.stop_gradient(ratio) > c.tis_cap)
        return loss, reg

    def loss(self, inp: LossInputs[Any]) -> tuple[Any, dict[str, float]]:
        """Scalar loss share of this micro-batch and its diagnostics.

        Args:
            inp: the micro-batch (``normalizer`` from ``self.normalizer`` on the whole batch).
        """
        self._check(inp)
        c, ops = self.cfg, self.ops
        mask, logp, blogp = self._masked_inputs(inp)
        adv = self._advantages(inp)
        lr = core.log_ratio(ops, logp, blogp, mask)
        ratio = ops.exp(lr)
        per_token, reg = self._surrogate(logp, lr, ratio, adv)
        blocked = None
        if c.gate != "none":
            lo, hi = c.gate_deltas()
            blocked = core.gate_blocked(ops, logp, blogp, adv, mask, c.gate, lo, hi)
            per_token = per_token * (1.0 - blocked)
        pg_loss = core.reduce_tokens(ops, per_token, mask, inp.normalizer, self.reduction)
        kl_loss, _, kl_sum = self._kl(inp, logp, mask, self.reduction)
        total = pg_loss if kl_loss is None else pg_loss + kl_loss
        echo = self._echo(inp)
        if echo is not None and echo.loss is not None:
            total = total + echo.loss
        return total, self._metrics(inp, logp, ratio, adv, mask, reg, blocked, pg_loss, kl_loss, kl_sum,
                                    echo.sums if echo is not None else {})

    def _metrics(self, inp: LossInputs[Any], logp: Any, ratio: Any, adv: Any, mask: Any, reg: dict[str, Any],
                 blocked: Any, pg_loss: Any, kl_loss: Any, kl_sum: Any, extra: dict[str, Any]) -> dict[str, float]:
        ops = self.ops
        sg = ops.stop_gradient
        pos, neg = ops.f32(adv > 0) * mask, ops.f32(adv < 0) * mask
        r = sg(ratio)
        sums: dict[str, Any] = {
            "tokens": ops.sum(mask),
            "seqs": ops.sum(ops.f32(ops.sum(mask, axis=1) > 0)),
            "tokens_pos": ops.sum(pos),
            "tokens_neg": ops.sum(neg),
            "clip_frac_low": ops.sum(reg["clip_low"] * mask),
            "clip_frac_high": ops.sum(reg["clip_high"] * mask),
            "dual_clip_frac": ops.sum(reg["dual_clip"] * mask),
            "ratio_mean": ops.sum(r * mask),
            "entropy_proxy": -ops.sum(ops.where(mask > 0, sg(logp), 0.0)),
        }
        if "tis" in reg:
            sums["tis_frac"] = ops.sum(reg["tis"] * mask)
        per_seq_blocked = None
        if blocked is not None:
            sums["gate_frac"] = ops.sum(blocked)
            sums["gate_frac_pos"] = ops.sum(blocked * pos)
            sums["gate_frac_neg"] = ops.sum(blocked * neg)
            per_seq_blocked = ops.sum(blocked, axis=1) if inp.version_lag is not None else None
        if kl_sum is not None:
            sums["kl"] = kl_sum
        sums.update(extra)
        values = {"pg_loss": sg(pg_loss)}
        if kl_loss is not None:
            values["kl_loss"] = sg(kl_loss)
        maxes = {"ratio_max": ops.max(ops.where(mask > 0, r, 0.0))}
        return core.diagnostics(ops, sums=sums, maxes=maxes, values=values, per_seq_blocked=per_seq_blocked,
                                mask=mask, version_lag=inp.version_lag)
