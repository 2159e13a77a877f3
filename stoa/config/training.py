"""``TrainingConfig``: the settings of whatever learns (fleet trainer, local mode), and ``algo_config``.

One set of names for both modes: ``n_samples`` completions per prompt, ``groups_per_step`` groups per
optimizer step, ``max_new_tokens`` per completion, ``checkpoint_every`` steps between saves. Stdlib only
(the task and algorithm modules are imported when a config is validated).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from stoa.algorithms import AlgoConfig
from stoa.config.base import BaseConfig, ConfigError, at_least, setting
from stoa.tasks import TaskPluginError, check_file_options, parse_task_spec

if TYPE_CHECKING:
    from stoa.algorithms import AlgoConfig

ALGO_TWINS: dict[str, str] = {"kl_beta": "kl_beta", "temperature": "temperature",
                              "max_new_tokens": "max_tokens"}
"""Field -> the ``[algo]`` knob it sets: a value may be given as one or the other, never both."""


class TwinClash(NamedTuple):
    """A field and its ``[algo]`` knob both set (see ``ALGO_TWINS``)."""

    name: str
    knob: str


def twin_clash(cfg: TrainingConfig) -> TwinClash | None:
    """The first field of ``cfg`` whose ``[algo]`` knob is set too (kl_beta counts only when set), or None.

    Args:
        cfg: a learner's config.
    """
    for name, knob in ALGO_TWINS.items():
        if knob in cfg.algo and getattr(cfg, name) is not None:
            return TwinClash(name, knob)
    return None


def twin_error(clash: TwinClash, field_place: str, knob_place: str) -> ConfigError:
    """The error for a clash, naming both places: kl_beta given twice, or a knob that only a field may set.

    Args:
        clash: the field and knob.
        field_place: where the field was given, e.g. ``--kl-beta``.
        knob_place: where the knob was given, e.g. ``[algo] kl_beta in run.toml``.
    """
    if clash.name == "kl_beta":
        return ConfigError(clash.name, f"given twice, as {field_place} and as {knob_place}; keep one")
    return ConfigError(f"algo.{clash.knob}", f"{knob_place} duplicates the '{clash.name}' setting; remove it "
                                             "from [algo]")


@dataclass(frozen=True)
class TrainingConfig(BaseConfig):
    """Settings of a learner: the task, the rollout shape, the objective and the optimizer."""

    task: str = setting("arithmetic", "Task spec, e.g. 'arithmetic', 'arithmetic:digits=3', 'toy', "
                                      "'gsm8k:path=FILE'.")
    groups_per_step: int = setting(8, "Prompt groups per optimizer step (B).")
    max_new_tokens: int = setting(64, "Completion length cap (new tokens per completion).")
    temperature: float = setting(1.0, "Sampling temperature (rollouts sample with it, the loss scores with "
                                      "it).")
    top_p: float = setting(1.0, "Sampling nucleus mass; 1.0 keeps importance ratios exact.")
    algorithm: str = setting("grpo", "RL objective: grpo, dr_grpo, dapo, gspo, rloo, cispo, gigpo (multi-turn: "
                                     "GRPO plus anchor-state step advantages).")
    algo: dict = setting({}, "Algorithm knobs (eps_low, eps_high, dual_clip_c, gate, ..., gigpo_omega, gigpo_gamma, "
                             "echo_alpha, echo_schedule; see stoa.algorithms.AlgoConfig); TOML table [algo], "
                             "flag --algo KEY=VALUE.")
    kl_beta: float | None = setting(None, "KL-to-reference coefficient; 0 skips the reference forward "
                                          "(default: the algorithm's, 0.001 for grpo, 0 for dapo).")
    lr: float = setting(1e-5, "AdamW learning rate.")
    weight_decay: float = setting(0.0, "AdamW decoupled weight decay.")
    grad_clip: float = setting(1.0, "Clip the global gradient norm to this (0 disables).")
    micro_batch: int = setting(16, "Sequences per forward/backward micro-batch (gradient accumulation).")
    gradient_checkpointing: bool = setting(False, "Recompute activations in backward to save memory.")
    steps: int = setting(0, "Total optimizer steps of the run, counting the steps taken before a restart: "
                            "a resumed run stops once it reaches this many (0 = run forever).")
    checkpoint_every: int = setting(1, "Save the trainable weights and optimizer state every this many "
                                       "steps.")
    eval_every: int = setting(0, "Held-out greedy accuracy every this many steps (0 = only at start and "
                                 "end).")
    eval_n: int = setting(64, "Held-out prompts per greedy evaluation.")

    def validate(self) -> TrainingConfig:
        """Raise ``ConfigError`` naming the first invalid field; return self."""
        super().validate()
        self._check_task()
        if self.n_samples < 2:
            raise ConfigError("n_samples", f"group-relative advantages need at least 2 samples per group, "
                                           f"got {self.n_samples}")
        at_least(self, 1, ("groups_per_step", "max_new_tokens"))
        at_least(self, 0, ("micro_batch", "steps", "checkpoint_every", "eval_every", "eval_n", "seed",
                           "weight_decay", "grad_clip"))
        if not 0 < self.lr < 1:
            raise ConfigError("lr", f"must be in (0, 1), got {self.lr}")
        if self.kl_beta is not None and self.kl_beta < 0:
            raise ConfigError("kl_beta", f"must be >= 0, got {self.kl_beta}")
        if not self.temperature > 0:
            raise ConfigError("temperature", f"must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        self._check_echo_schedule(self.algo_config())
        return self

    def _check_echo_schedule(self, algo: AlgoConfig) -> None:
        """The ECHO taper runs over the run's total steps, so it needs a finite run."""
        if algo.echo_schedule == "linear_taper_to_zero" and algo.echo_alpha > 0 and self.steps < 1:
            raise ConfigError("algo.echo_schedule", "'linear_taper_to_zero' tapers over the run's total steps: "
                                                    "set steps >= 1, or use echo_schedule = 'constant'")

    def _check_task(self) -> None:

        try:
            check_file_options(*parse_task_spec(self.task))
        except TaskPluginError:  # the plugin's own fault: its exit code, not a setting's
            raise
        except ValueError as e:
            raise ConfigError("task", str(e)) from None

    def algo_config(self) -> AlgoConfig:
        """The validated ``AlgoConfig``: the algorithm's preset, the [algo] knobs, kl_beta, temperature and
        max_new_tokens (as the knob ``max_tokens``).

        Raises:
            ConfigError: a knob also set by a field (``kl_beta`` both ways, ``temperature`` or ``max_tokens``
                in [algo]), or an invalid algorithm or knob, naming it.
        """

        knobs = dict(self.algo)
        clash = twin_clash(self)
        if clash is not None:
            raise twin_error(clash, clash.name, f"[algo] {clash.knob}")
        if self.kl_beta is not None:
            knobs["kl_beta"] = self.kl_beta
        knobs.update(temperature=self.temperature, max_tokens=self.max_new_tokens)
        try:
            return AlgoConfig.from_dict({"name": self.algorithm, **knobs})
        except ValueError as e:
            head = str(e).split(":", 1)[0]
            raise ConfigError("algorithm" if head == "name" else f"algo.{head}", str(e)) from None
