"""``TrainerConfig``: the fleet trainer, a learner (``TrainingConfig``) that meets its workers at a bucket."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from stoa.config.base import PLANES, ConfigError, FleetConfig, at_least, setting
from stoa.config.training import TrainingConfig


@dataclass(frozen=True)
class TrainerConfig(TrainingConfig, FleetConfig):
    """Trainer settings. Everything a worker must agree on ends up in the run contract."""

    SECTION: ClassVar[str] = "trainer"

    staleness_bound: int = setting(3, "Use records with current_version - policy_version <= this.")
    reuse_cap: int = setting(2, "Use each record in at most this many optimizer steps.")
    anchor_every: int = setting(16, "Publish a full anchor every this many versions (patches in between).")
    keep_versions: int = setting(8, "Keep weights objects for at least this many recent versions.")
    shared_prefix: bool = setting(False, "Run each group's prompt once in forward/backward (fewer FLOPs, "
                                         "~30% less memory, but one group per micro-batch); off packs whole "
                                         "sequences.")
    poll_seconds: float = setting(0.5, "Sleep between bucket listings while waiting for records.")
    max_wait_seconds: float = setting(0.0, "Exit with an error if no usable record arrives for this long "
                                           "(0 = wait forever).")
    quarantine: bool = setting(True, "Skip the records of a worker whose rejection rate or logprob "
                                     "disagreement (at lag 0) is over threshold; false turns quarantine off.")
    quarantine_disagreement: float = setting(0.15, "Quarantine a worker whose median exp|recorded - "
                                                   "recomputed logprob| - 1 over its lag-0 tokens exceeds "
                                                   "this (set for temperature 1 and top_p 1, scaled to the "
                                                   "run's; honest bf16/fp32 torch and MLX workers measured "
                                                   "<= 0.054: `stoa bench quarantine`).")
    quarantine_reject_rate: float = setting(0.5, "Quarantine a worker once more than this fraction of its "
                                                 "records is rejected.")
    quarantine_min_records: int = setting(8, "Records a worker must have sent before its rates are judged.")

    def validate(self) -> TrainerConfig:
        """Raise ``ConfigError`` naming the first invalid field; return self."""
        super().validate()
        if self.plane not in PLANES:
            raise ConfigError("plane", f"{self.plane!r} is not one of {PLANES}")
        at_least(self, 1, ("micro_batch", "anchor_every", "checkpoint_every", "keep_versions", "reuse_cap",
                           "quarantine_min_records"))
        at_least(self, 0, ("staleness_bound",))
        if self.quarantine_disagreement <= 0:
            raise ConfigError("quarantine_disagreement", "must be > 0 (turn quarantine off with quarantine = "
                                                         "false)")
        if not 0 < self.quarantine_reject_rate <= 1:
            raise ConfigError("quarantine_reject_rate", f"must be in (0, 1], got "
                                                        f"{self.quarantine_reject_rate}")
        if self.keep_versions < self.staleness_bound + 1:
            raise ConfigError("keep_versions", f"must be >= staleness_bound + 1 = {self.staleness_bound + 1}")
        return self
