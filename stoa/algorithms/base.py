"""Backend-free algorithm contract: the config, the loss inputs, the Algorithm protocol (merging: ``metrics``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

import numpy as np

ALGORITHM_NAMES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "gspo", "rloo", "cispo", "gigpo")
GATES: tuple[str, ...] = ("none", "tv", "kl")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
ECHO_SCHEDULES: tuple[str, ...] = ("constant", "linear_taper_to_zero")

# DPPO thresholds used by the paper's authors in their released recipe (arXiv 2602.04879):
# 0.15 on the binary total variation |p - mu|, 0.05 on the binary KL.
DEFAULT_GATE_DELTAS: dict[str, float] = {"tv": 0.15, "kl": 0.05}

# Per-algorithm defaults applied by AlgoConfig.preset and AlgoConfig.from_dict (on top of the
# dataclass defaults, which are GRPO's).
PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {},
    "dr_grpo": {"adv_std_norm": False},
    "dapo": {"eps_high": 0.28, "kl_beta": 0.0},
    "gspo": {"gate": "none", "dual_clip_c": None},
    "rloo": {"adv_std_norm": False},
    "cispo": {"gate": "none", "dual_clip_c": None},
    "gigpo": {},
}

Reduction = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "seq_mean"]
Backend = Literal["torch", "mlx"]


def _fail(field: str, msg: str) -> ValueError:
    return ValueError(f"{field}: {msg}")


@dataclass(frozen=True)
class AlgoConfig:
    """Knobs of the RL objective, shared by the torch trainer and the MLX local mode.

    Build it with ``AlgoConfig.preset(name, **overrides)`` or ``AlgoConfig.from_dict(d)``: both start
    from the algorithm's preset (``PRESETS``). The bare constructor uses GRPO's defaults for every
    field and validates on construction, so a contradiction (e.g. ``AlgoConfig(name="gspo")`` with the
    default token gate) fails at once with a ``ValueError`` naming the field.
    """

    name: str = "grpo"
    """Algorithm: 'grpo', 'dr_grpo', 'dapo', 'gspo', 'rloo', 'cispo' or 'gigpo'."""

    eps_low: float = 0.2
    """PPO clip below: the ratio is clipped at 1 - eps_low for negative advantages. In [0, 1]; 1 disables
    the lower clip. Used by grpo, dr_grpo, dapo, rloo."""

    eps_high: float = 0.2
    """PPO clip above: the ratio is clipped at 1 + eps_high for positive advantages. > 0; ``math.inf``
    disables the upper clip. DAPO's preset raises it to 0.28 (clip-higher)."""

    dual_clip_c: float | None = 3.0
    """Dual-clip bound (arXiv 1912.09729): for negative advantages the token loss is capped at c * |A|.
    > 1, or None to disable. Not used by cispo (its IS weight is already capped)."""

    gate: str = "tv"
    """DPPO trust-region gate (arXiv 2602.04879) on the sampled token's probability p against the
    behaviour probability mu: 'tv' (binary total variation |p - mu|), 'kl' (binary KL between
    Bernoulli(mu) and Bernoulli(p)) or 'none'. Tokens that moved past the threshold in the direction
    the advantage pushes are dropped from the loss. Token-level, so not used by gspo."""

    gate_delta_low: float | None = None
    """Gate threshold for negative advantages (probability moved down). None: the paper recipe's
    value for the chosen gate, 0.15 for 'tv' and 0.05 for 'kl'."""

    gate_delta_high: float | None = None
    """Gate threshold for positive advantages (probability moved up). None: as ``gate_delta_low``."""

    tis_cap: float | None = None
    """Truncated importance sampling: caps the per-token importance weight pi/mu at this value (the
    token surrogate is multiplied by stop_grad(min(r, cap) / r), so the gradient weight r * A becomes
    min(r, cap) * A; gspo applies it to the sequence ratio). None disables. Not used by cispo."""

    kl_beta: float = 0.001
    """Weight of the KL penalty to the reference policy, added per token under the algorithm's
    reduction. 0 skips it and the trainer then skips the reference forward. DAPO's preset sets 0."""

    kl_estimator: str = "k3"
    """KL estimator on d = logp - ref_logp: 'k1' = d, 'k2' = d^2 / 2, 'k3' = exp(-d) + d - 1."""

    adv_std_norm: bool = True
    """Divide the group-centred rewards by the group's standard deviation. True for grpo, dapo, gspo,
    cispo; dr_grpo and rloo are defined without it (their presets set False, and True is rejected)."""

    max_tokens: int | None = None
    """Completion length cap (the run contract's max new tokens). Required by dr_grpo (its constant
    normaliser) and by DAPO's overlong shaping."""

    overlong_buffer: int = 0
    """DAPO soft overlong punishment: completions longer than max_tokens - overlong_buffer lose reward
    linearly, reaching -overlong_penalty at max_tokens. 0 disables (the DAPO paper used a buffer of
    4096 for a 20480 cap). Any algorithm may use it."""

    overlong_penalty: float = 1.0
    """Reward taken from a completion that reaches max_tokens under the overlong shaping. >= 0."""

    temperature: float = 1.0
    """Sampling temperature: logits are divided by it before the log-softmax (``token_logprobs``); it
    must equal the workers' sampling temperature or the ratios are biased."""

    gspo_eps_low: float = 3e-4
    """GSPO's sequence-ratio clip below (1 - gspo_eps_low); the paper's 3e-4."""

    gspo_eps_high: float = 4e-4
    """GSPO's sequence-ratio clip above (1 + gspo_eps_high); the paper's 4e-4."""

    cispo_eps_high: float = 4.0
    """CISPO's IS-weight clip: the detached weight is min(r, 1 + cispo_eps_high); there is no lower
    clip. The MiniMax-M1 report does not publish its value; 4.0 is stoa's choice."""

    gigpo_omega: float = 1.0
    """GiGPO's weight of the step advantage: the action tokens of turn t get A_episode + omega * A_step(t).
    >= 0; 0 is GRPO. Used by gigpo only."""

    gigpo_gamma: float = 0.95
    """GiGPO's discount of the sparse final reward R over the K turns of an episode: turn t's return is
    gamma^(K-1-t) * R, normalised within its anchor group. In [0, 1]. Used by gigpo only."""

    echo_alpha: float = 0.0
    """ECHO coefficient (every algorithm): adds alpha * (NLL of the echo tokens, i.e. tool-response tokens
    tagged ROLE_ECHO) / (the whole batch's echo-token count) to the loss, with no ratio and no KL. >= 0;
    0 disables it (the loss is then exactly the algorithm's)."""

    echo_schedule: str = "constant"
    """How echo_alpha evolves over a run (``echo_coefficient``): 'constant', or 'linear_taper_to_zero'
    (alpha * max(0, 1 - step / total_steps); needs the run's total steps)."""

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> AlgoConfig:
        """The algorithm's recommended config, with ``overrides`` applied on top.

        Args:
            name: algorithm name (one of ``ALGORITHM_NAMES``).
            overrides: field values that replace the preset's.
        """
        if name not in PRESETS:
            raise _fail("name", f"unknown algorithm {name!r}; known: {', '.join(ALGORITHM_NAMES)}")
        unknown = sorted(set(overrides) - _FIELD_NAMES)
        if unknown:
            raise _fail(unknown[0], f"unknown config key(s) {unknown}")
        return cls(**{**PRESETS[name], **overrides, "name": name})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AlgoConfig:
        """Build from a mapping: the preset of ``d['name']`` (default 'grpo'), then the other keys.

        Args:
            d: field name -> value; unknown keys raise a ValueError naming them.
        """
        if not isinstance(d, Mapping):
            raise _fail("algo", f"expected a mapping, got {type(d).__name__}")
        unknown = sorted(set(d) - _FIELD_NAMES)
        if unknown:
            raise _fail(unknown[0], f"unknown config key(s) {unknown}; known: {sorted(_FIELD_NAMES)}")
        rest = {k: v for k, v in d.items() if k != "name"}
        return cls.preset(d.get("name", "grpo"), **rest)

    def to_dict(self) -> dict[str, Any]:
        """All fields as a plain dict (``from_dict(to_dict())`` round-trips)."""
        return dataclasses.asdict(self)

    def gate_deltas(self) -> tuple[float, float]:
        """The gate thresholds (delta_low, delta_high) with the paper defaults filled in."""
        default = DEFAULT_GATE_DELTAS.get(self.gate, 0.0)
        low = default if self.gate_delta_low is None else float(self.gate_delta_low)
        high = default if self.gate_delta_high is None else float(self.gate_delta_high)
        return low, high

    def validate(self) -> AlgoConfig:
        """Raise ValueError('<field>: ...') for unknown names, out-of-range values and contradictions."""
        if self.name not in ALGORITHM_NAMES:
            raise _fail("name", f"unknown algorithm {self.name!r}; known: {', '.join(ALGORITHM_NAMES)}")
        self._check_ranges()
        self._check_contradictions()
        return self

    def _check_ranges(self) -> None:
        def real(field: str, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
                 optional: bool = False, allow_inf: bool = False) -> None:
            v: Any = getattr(self, field)
            if v is None and optional:
                return
            if not isinstance(v, int | float) or isinstance(v, bool):
                raise _fail(field, f"expected a number, got {v!r}")
            if math.isnan(v) or (math.isinf(v) and not allow_inf):
                raise _fail(field, f"must be finite, got {v!r}")
            if lo is not None and (v < lo or (lo_open and v == lo)):
                raise _fail(field, f"must be {'>' if lo_open else '>='} {lo}, got {v!r}")
            if hi is not None and v > hi:
                raise _fail(field, f"must be <= {hi}, got {v!r}")

        real("eps_low", lo=0.0, hi=1.0)
        real("eps_high", lo=0.0, lo_open=True, allow_inf=True)
        real("dual_clip_c", lo=1.0, lo_open=True, optional=True)
        if self.gate not in GATES:
            raise _fail("gate", f"unknown gate {self.gate!r}; known: {', '.join(GATES)}")
        for f in ("gate_delta_low", "gate_delta_high"):
            real(f, lo=0.0, lo_open=True, hi=1.0 if self.gate == "tv" else None, optional=True)
        real("tis_cap", lo=0.0, lo_open=True, optional=True)
        real("kl_beta", lo=0.0)
        if self.kl_estimator not in KL_ESTIMATORS:
            raise _fail("kl_estimator", f"unknown estimator {self.kl_estimator!r}; known: k1, k2, k3")
        if not isinstance(self.adv_std_norm, bool):
            raise _fail("adv_std_norm", f"expected a bool, got {self.adv_std_norm!r}")
        for f in ("max_tokens", "overlong_buffer"):
            v = getattr(self, f)
            if v is None and f == "max_tokens":
                continue
            if not isinstance(v, int) or isinstance(v, bool):
                raise _fail(f, f"expected an int, got {v!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise _fail("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.overlong_buffer < 0:
            raise _fail("overlong_buffer", f"must be >= 0, got {self.overlong_buffer}")
        real("overlong_penalty", lo=0.0)
        real("temperature", lo=0.0, lo_open=True)
        real("gspo_eps_low", lo=0.0, lo_open=True, hi=1.0)
        real("gspo_eps_high", lo=0.0, lo_open=True)
        real("cispo_eps_high", lo=0.0, lo_open=True)
        real("gigpo_omega", lo=0.0)
        real("gigpo_gamma", lo=0.0, hi=1.0)
        real("echo_alpha", lo=0.0)
        if self.echo_schedule not in ECHO_SCHEDULES:
            raise _fail("echo_schedule", f"unknown schedule {self.echo_schedule!r}; known: {', '.join(ECHO_SCHEDULES)}")

    def _check_contradictions(self) -> None:
        n = self.name
        if self.gate == "none":
            for f in ("gate_delta_low", "gate_delta_high"):
                if getattr(self, f) is not None:
                    raise _fail(f, "set while gate is 'none'")
        if n == "dr_grpo" and self.max_tokens is None:
            raise _fail("max_tokens", "dr_grpo normalises by a constant length: set max_tokens")
        if n in ("dr_grpo", "rloo") and self.adv_std_norm:
            raise _fail("adv_std_norm", f"{n} is defined without std normalisation; use AlgoConfig.preset({n!r})")
        if self.overlong_buffer > 0:
            if self.max_tokens is None:
                raise _fail("max_tokens", "overlong_buffer > 0 needs max_tokens")
            if self.overlong_buffer >= self.max_tokens:
                raise _fail("overlong_buffer", f"must be < max_tokens ({self.max_tokens}), got {self.overlong_buffer}")
        if n == "gspo" and self.gate != "none":
            raise _fail("gate", "gspo clips a sequence-level ratio; the token gate does not apply (set 'none')")
        if n == "cispo" and self.dual_clip_c is not None:
            raise _fail("dual_clip_c", "cispo has no clipped surrogate to dual-clip (set None)")
        if n == "cispo" and self.tis_cap is not None:
            raise _fail("tis_cap", "cispo caps its IS weight with cispo_eps_high (set None)")


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(AlgoConfig))

A = TypeVar("A")


@dataclass
class LossInputs(Generic[A]):
    """One micro-batch for ``Algorithm.loss``; arrays are torch tensors or mx arrays, [B, T] unless noted.

    The fields after ``normalizer`` are optional, so single-turn callers need not know about them.

    Attributes:
        logp: current-policy logprobs of the sampled tokens (carries the gradient), at every position (the
            echo term reads them on echo tokens).
        behaviour_logp: the worker-recorded logprobs (the 'old' policy of the PPO ratio); read on ``mask``
            only, so observation tokens may hold anything (even NaN).
        ref_logp: reference-policy logprobs, or None (required when kl_beta > 0); read on ``mask`` only.
        advantages: [B] per-sequence advantages, broadcast over tokens.
        mask: float, 1 on the action tokens that are trained on (multi-turn: ``roles == ROLE_ACTION``);
            ratio, clip, DPPO gate and KL see these tokens only.
        normalizer: the whole batch's ``Algorithm.normalizer`` (identical for every micro-batch).
        version_lag: optional [B] ints (trainer version - record version), for diagnostics only.
        token_advantages: optional [B, T] per-token advantages (GiGPO: ``Batch.token_advantages``); when
            given they replace ``advantages`` in the loss (token-level algorithms only).
        echo_mask: optional float [B, T], 1 on the echo tokens (``roles == ROLE_ECHO``); None: no echo term.
        echo_normalizer: the whole batch's echo-token count (``Batch.echo_normalizer``, >= 1).
        echo_alpha: this step's ECHO coefficient (``Algorithm.echo_coefficient(step, total_steps)``); None:
            ``cfg.echo_alpha`` (refused under the 'linear_taper_to_zero' schedule, which needs the step).
        echo_hits: optional 0/1 [B, T]: whether the forward's argmax equals the target (``Ops.token_hits``);
            gives the ``echo_acc`` metric.
    """

    logp: A
    behaviour_logp: A
    ref_logp: A | None
    advantages: A
    mask: A
    normalizer: float
    version_lag: np.ndarray | Sequence[int] | None = None
    token_advantages: A | None = None
    echo_mask: A | None = None
    echo_normalizer: float = 1.0
    echo_alpha: float | None = None
    echo_hits: A | None = None


def echo_coefficient(cfg: AlgoConfig, step: int, total_steps: int) -> float:
    """The ECHO coefficient at optimizer step ``step`` of ``total_steps``.

    'constant': ``cfg.echo_alpha``; 'linear_taper_to_zero': ``cfg.echo_alpha * max(0, 1 - step / total_steps)``.

    Args:
        cfg: the algorithm config.
        step: the optimizer step about to be taken (0 for the first).
        total_steps: the run's total steps (needed by the taper only).
    """
    if step < 0:
        raise _fail("step", f"must be >= 0, got {step}")
    if cfg.echo_schedule == "constant" or cfg.echo_alpha == 0:
        return float(cfg.echo_alpha)
    if total_steps < 1:
        raise _fail("total_steps", f"the 'linear_taper_to_zero' echo schedule needs the run's total steps (>= 1), "
                                   f"got {total_steps}")
    return float(cfg.echo_alpha) * max(0.0, 1.0 - step / total_steps)


class Algorithm(Protocol):
    """What the trainer (torch) and the MLX local mode call, without knowing which algorithm runs."""

    cfg: AlgoConfig
    reduction: Reduction

    def shape_rewards(self, rewards: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Rewards [G, n] after reward shaping (DAPO's overlong punishment when enabled)."""
        ...

    def advantages(self, rewards: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Advantages [G, n] float32 from raw rewards and completion lengths [G, n] (shaping included)."""
        ...

    def turn_advantages(self, rewards: np.ndarray, lengths: np.ndarray,
                        states: Sequence[Sequence[Sequence[str]]]) -> list[list[np.ndarray]] | None:
        """What each model turn adds to its row's advantage ([G][n] float64 arrays [K]), or None: nothing
        (every algorithm but gigpo, and gigpo on a batch without anchor states)."""
        ...

    def echo_coefficient(self, step: int, total_steps: int) -> float:
        """The ECHO coefficient of optimizer step ``step`` (``echo_coefficient``), for ``LossInputs.echo_alpha``."""
        ...

    def keep_groups(self, rewards: np.ndarray) -> np.ndarray:
        """bool [G]: which groups to train on (DAPO drops zero-variance groups; others keep all)."""
        ...

    def normalizer(self, mask_all: np.ndarray) -> float:
        """The loss denominator computed once from the WHOLE batch's mask [B, T]."""
        ...

    def token_logprobs(self, logits: Any, targets: Any) -> Any:
        """Logprobs [B, T] of ``targets`` under ``logits`` [B, T, V] / temperature (backend arrays)."""
        ...

    def token_hits(self, logits: Any, targets: Any) -> Any:
        """0/1 float [B, T]: argmax of ``logits`` [B, T, V] equals ``targets`` (``LossInputs.echo_hits``)."""
        ...

    def loss(self, inp: LossInputs[Any]) -> tuple[Any, dict[str, float]]:
        """(scalar loss of this micro-batch, diagnostics); micro-batch losses sum to the batch loss."""
        ...
