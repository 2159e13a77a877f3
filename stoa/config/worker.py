"""``WorkerConfig``: a rollout worker. Sampling settings and the group size come from the run contract."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from stoa.config.base import DTYPES, ENGINES, WORKER_DEVICES, ConfigError, FleetConfig, at_least, one_of, setting

WORKER_DTYPES = DTYPES


@dataclass(frozen=True)
class WorkerConfig(FleetConfig):
    """Rollout worker settings. Sampling and group size come from the run contract."""

    SECTION: ClassVar[str] = "worker"
    DEVICES: ClassVar[re.Pattern[str]] = WORKER_DEVICES

    model: str = setting("", "Model: a built-in name (tiny, smollm2-135m), a local model directory or a hub id; "
                             "checked against the contract (default: the run's model files from the bucket).")
    n_samples: int = setting(0, "Group size this worker expects (0 = the contract's).")
    seed: int = setting(-1, "Sampling seed (-1 = random per process).")
    plane: str = setting("", "Weight plane this worker expects (empty = the contract's).")
    name: str = setting("", "Worker label used in record keys (default: host name); a random suffix is "
                            "added.")
    engine: str = setting("auto", "Generation engine: auto (mlx on Apple silicon, else torch), torch, mlx.")
    groups_in_flight: int = setting(0, "Prompt groups decoded together (batch = this x n); 0 = from the "
                                       "memory tier (see --print-tier; env STOA_GROUPS_IN_FLIGHT).")
    episode_queue: int = setting(4, "Multi-turn tasks on the torch engine: this many batches of groups_in_flight "
                                    "groups are sampled in one call on the decode slots of one (groups_in_flight x "
                                    "n rows): an episode that ends gives its slot to a queued one (continuous "
                                    "batching). 1 = one batch, no queue.")
    run: str = setting("default", "Run id, required: the run to join (runs/<run>/ in the bucket). [default: none]")
    max_groups: int = setting(0, "Exit after uploading this many groups (0 = run forever).")
    poll_seconds: float = setting(2.0, "Wait between pointer polls while the run has no weights yet.")
    wait_seconds: float = setting(600.0, "Give up if the run contract or weights do not appear within this "
                                         "long.")
    trainer_stale_seconds: float = setting(300.0, "Pause sampling while the trainer's heartbeat in the run "
                                                  "status has not moved for this long (or 3 of its step "
                                                  "times, if longer).")
    status_seconds: float = setting(0.5, "Read the run status (finished, heartbeat, wanted groups) at most "
                                         "this often, next to the pointer poll.")
    backpressure: bool = setting(True, "Pause while the trainer says it wants no more groups (false: "
                                       "sample regardless).")
    pacing: bool = setting(True, "Share the trainer's want by speed (this worker's groups per minute against the "
                                 "fleet's, from the run status) and size batches to land inside the staleness "
                                 "window (false: equal shares, batches of groups_in_flight; off without "
                                 "backpressure).")
    threads: int = setting(0, "Torch CPU threads (0 = library default).")
    dtype: str = setting("auto", "Compute dtype: auto (torch: bf16 on CUDA and on CPUs with native bf16 when "
                                 "the plane is bf16, else fp32; mlx: bf16 on Metal, else fp32), float32, "
                                 "bfloat16.")
    bucket_retry_seconds: float = setting(300.0, "Retry budget of one bucket request (jittered exponential "
                                                 "backoff) before it counts as an outage; overrides "
                                                 "STOA_BUCKET_RETRY_TIMEOUT_S.")
    run_key_pub: str = setting("", "The run's public key (64 hex digits, from its join card or trainer log) that "
                                   "run.json must carry; empty: trust the key first seen for this bucket and "
                                   "run, and refuse a later change.")
    worker_key: str = setting("", "This worker's key file for the run (stoa worker-key issue NAME --out FILE): "
                                  "every record is signed with it and the key's name is the worker's label. "
                                  "Empty: unsigned records, which a run with worker keys refuses.")
    exit_on_outage: bool = setting(False, "Exit (code 4) when a bucket request exhausts its retry budget; by "
                                          "default the worker waits and retries until the bucket answers "
                                          "again.")

    def validate(self) -> WorkerConfig:
        """Raise ``ConfigError`` naming the first invalid field; return self."""
        super().validate()
        one_of(self, "engine", ENGINES)
        at_least(self, 0, ("groups_in_flight", "max_groups", "threads"))
        at_least(self, 1, ("episode_queue",))
        if not (self.trainer_stale_seconds > 0 and self.status_seconds > 0):
            raise ConfigError("trainer_stale_seconds" if self.trainer_stale_seconds <= 0 else "status_seconds",
                              "must be > 0")
        if self.poll_seconds <= 0 or self.wait_seconds <= 0:
            raise ConfigError("poll_seconds" if self.poll_seconds <= 0 else "wait_seconds", "must be > 0")
        if self.name and not all(c.isalnum() or c in "-_." for c in self.name):
            raise ConfigError("name", f"{self.name!r}: use letters, digits, '-', '_' or '.'")
        one_of(self, "dtype", WORKER_DTYPES)
        if not self.bucket_retry_seconds > 0:
            raise ConfigError("bucket_retry_seconds", "must be > 0 (seconds one bucket request may retry)")
        return self
