"""CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE with a clipped, detached IS weight on every token."""

# Departs from the paper: the upper IS clip is cispo_eps_high (4.0 by default; the report gives no
# value) and there is no lower clip (the paper sets its lower epsilon large); the ratio's "old" policy
# is the worker-recorded behaviour logprob; the DPPO gate is optional (off in the preset, as in the
# paper) and so is the KL term.

from __future__ import annotations

from typing import Any

from stoa.algorithms.bases import TokenPolicyAlgorithm


class CISPO(TokenPolicyAlgorithm):
    """Token loss -stop_grad(min(r, 1 + cispo_eps_high)) * A * logp, token mean over the batch."""

    name = "cispo"
    reduction = "token_mean"

    def _surrogate(self, logp: Any, lr: Any, ratio: Any, adv: Any) -> tuple[Any, dict[str, Any]]:
        ops = self.ops
        cap = 1.0 + self.cfg.cispo_eps_high
        weight = ops.stop_gradient(ops.clip(ratio, None, cap))
        zeros = ops.f32(adv > 0) * 0.0 * weight
        capped = ops.f32(ops.stop_gradient(ratio) > cap)
        # The capped tokens still get a gradient (weight = cap); they are reported as clip_frac_high.
        return -weight * adv * logp, {"clip_low": zeros, "clip_high": capped, "dual_clip": zeros}
