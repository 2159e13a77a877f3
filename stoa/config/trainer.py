"""``TrainerConfig``: the fleet trainer, a learner (``TrainingConfig``) that meets its workers at a bucket."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from stoa.config.base import DTYPES, PLANES, ConfigError, FleetConfig, at_least, one_of, setting
from stoa.config.training import TrainingConfig

COMPUTE_WEIGHTS = ("autocast", "bf16_copy")
"""The ``compute_weights`` settings: cast the fp32 masters per forward under autocast, or keep a bf16 copy
(``stoa.trainer.compute_copy``)."""

LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
"""``lora_targets``' default: the attention and MLP projections, as PEFT names them."""

LORA_BASE_PLANES = ("", "int8g64", "int4g64")
"""The ``lora_base_plane`` settings: the base at the run's dtype, or quantized as that weights plane."""


def check_lora(cfg: TrainerConfig) -> None:
    """Raise ``ConfigError`` for LoRA settings that cannot train (``lora_rank`` 0 ignores the other two).

    Args:
        cfg: the trainer config.
    """
    at_least(cfg, 0, ("lora_rank",))
    if cfg.lora_base_plane and cfg.lora_rank == 0:
        raise ConfigError("lora_base_plane", "needs a LoRA run: set lora_rank > 0 or leave lora_base_plane empty")
    if cfg.lora_rank == 0:
        return
    if cfg.lora_base_plane not in LORA_BASE_PLANES:
        raise ConfigError("lora_base_plane", f"{cfg.lora_base_plane!r} is not a base plane; use int8g64, int4g64 "
                                             "or '' (the base at the compute dtype)")
    if cfg.lora_base_plane and cfg.plane != cfg.lora_base_plane:
        raise ConfigError("lora_base_plane", f"{cfg.lora_base_plane} base but plane {cfg.plane}: workers sample on "
                                             f"the plane's base; set plane = {cfg.lora_base_plane} too")
    if not cfg.lora_alpha > 0:
        raise ConfigError("lora_alpha", f"must be > 0, got {cfg.lora_alpha}; set it to e.g. 2 x lora_rank")
    names = [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    if not names:
        raise ConfigError("lora_targets", "names no module; give module-name suffixes such as q_proj,v_proj")
    bad = [t for t in names if not all(c.isalnum() or c in "_." for c in t) or t.startswith(".")]
    if bad:
        raise ConfigError("lora_targets", f"{bad[0]!r} is not a module-name suffix; give names such as "
                                          "q_proj,v_proj (letters, digits, '_' and '.')")


@dataclass(frozen=True)
class TrainerConfig(TrainingConfig, FleetConfig):
    """Trainer settings. Everything a worker must agree on ends up in the run contract.

    The trainer stores these settings in the bucket when it starts a run (``runs/<run>/config.json``), all but
    ``NOT_STORED``: the bucket URL, the run id, the log directory, the retriever (a path or an endpoint URL that
    may carry credentials), the model (a local path; the contract's fingerprints decide) and the machine's
    device and memory. A restart with only ``--bucket`` and ``--run`` takes every stored setting; a flag, TOML
    key or ``STOA_*`` variable that differs is refused naming both values, except the ``MAY_CHANGE`` settings
    (how long the run goes, how often it checkpoints, evaluates, reports, polls and logs, how it fits in
    memory), which take the new value for this trainer and are logged as one line.
    """

    SECTION: ClassVar[str] = "trainer"
    NOT_STORED: ClassVar[frozenset[str]] = frozenset({
        "bucket", "run", "log_dir", "retriever", "model", "device", "available_memory_gb", "run_key"})
    """Settings never written to the bucket: secrets and what belongs to one machine."""
    MAY_CHANGE: ClassVar[frozenset[str]] = frozenset({
        "steps", "checkpoint_every", "checkpoint_minutes", "keep_checkpoints", "checkpoint_async", "eval_every",
        "eval_n", "eval_k", "report_to", "poll_seconds", "status_seconds", "max_wait_seconds", "lease_ttl_seconds",
        "metrics_flush_rows", "metrics_flush_seconds", "preflight", "micro_batch", "gradient_checkpointing",
        "shared_prefix", "dtype", "compute_weights", "anchor_every", "keep_versions", "keep_rollout_versions",
        "backpressure", "worker_keys"})
    """Stored settings a restart may change (logged); every other stored one must agree with the run."""

    model: str = setting("tiny", "Model, required for a new run (a restart takes the run's): 'tiny', 'smollm2-135m', "
                                 "a local HF directory or a hub id. [default: none]")
    run: str = setting("default", "Run id, required: a new one is created, an existing one resumes; names "
                                  "runs/<run>/ in the bucket. [default: none]")
    checkpoint_every: int = setting(0, "Also save a checkpoint (fp32 master weights + AdamW moments, 12 bytes "
                                       "per parameter) every this many steps (0 = by time only, see "
                                       "checkpoint_minutes).")
    checkpoint_minutes: float = setting(30.0, "Save a checkpoint once this many minutes have passed since this "
                                              "trainer's last one (0 = by steps only); the run's last step is "
                                              "always saved when it finishes or stops on SIGINT/SIGTERM.")
    keep_checkpoints: int = setting(1, "Checkpoints kept in the bucket, newest first; older ones are deleted "
                                       "once the new one's pointer is written.")
    checkpoint_async: bool = setting(True, "Write checkpoints on a background thread from a copy of the state "
                                           "taken on the step's path (12 bytes per trainable parameter of host "
                                           "memory while a write runs; at most one in flight; world size 1 "
                                           "only, sharded trainers write synchronously); false: write on the "
                                           "step's path.")

    staleness_bound: int = setting(3, "Use records with current_version - policy_version <= this.")
    reuse_cap: int = setting(2, "Use each record in at most this many optimizer steps.")
    anchor_every: int = setting(16, "Publish a full anchor every this many versions (patches in between).")
    keep_versions: int = setting(8, "Keep weights objects for at least this many recent versions.")
    shared_prefix: bool = setting(True, "Run each group's prompt once in forward/backward, its completions on "
                                        "the prompt's KV cache (one group per micro-batch: fewer FLOPs, less "
                                        "memory; docs/memory.md); false packs whole sequences, micro_batch rows "
                                        "per pass.")
    poll_seconds: float = setting(0.5, "Sleep between bucket listings while waiting for records; it doubles "
                                       "with each listing that brings nothing, up to min(5 s, 10x this).")
    max_wait_seconds: float = setting(0.0, "Exit with an error if no usable record arrives for this long "
                                           "(0 = wait forever).")
    lease_ttl_seconds: float = setting(120.0, "One trainer per run: another trainer may take the run over "
                                              "(--take-over) once this trainer's lease heartbeat (renewed "
                                              "every few seconds) is older than this.")
    keep_rollout_versions: int = setting(0, "Retention: delete each rollout version prefix once it is this "
                                            "many versions below the staleness window (0 = as soon as it "
                                            "leaves it); -1 keeps every record (audit).")
    backpressure: bool = setting(True, "Publish in the run status how many more groups the trainer can use "
                                       "before they go stale; workers pause at 0 (false: never ask them to).")
    status_seconds: float = setting(10.0, "Rewrite the run status (the trainer's heartbeat) at least this "
                                          "often while waiting for records; once per version otherwise.")
    metrics_flush_rows: int = setting(20, "Upload buffered metrics rows as a chunk under runs/<run>/metrics/ "
                                          "every this many rows.")
    metrics_flush_seconds: float = setting(60.0, "Upload buffered metrics rows as a chunk once the oldest is this "
                                                 "old.")
    quarantine: bool = setting(True, "Skip the records of a worker whose rejection rate or logprob "
                                     "disagreement (at lag 0) is over threshold; false turns quarantine off.")
    quarantine_disagreement: float = setting(0.15, "Quarantine a worker whose median exp|recorded - "
                                                   "recomputed logprob| - 1 over its lag-0 tokens exceeds "
                                                   "this (set for temperature 1 and top_p 1, scaled to the "
                                                   "run's; honest bf16/fp32 torch and MLX workers measured "
                                                   "<= 0.054: `stoa bench quarantine`).")
    quarantine_sequential: bool = setting(True, "Also quarantine a worker whose lag-0 records disagree mildly but "
                                                "persistently: a CUSUM over its records' scores (each record's "
                                                "median exp|recorded - recomputed logprob| - 1, capped at "
                                                "quarantine_disagreement) minus quarantine_drift passes "
                                                "quarantine_evidence (stoa.trainer.sequential; docs/verification.md).")
    quarantine_drift: float = setting(0.065, "CUSUM reference per record (temperature 1, top_p 1, scaled to the "
                                             "run's like quarantine_disagreement): the ceiling of the calibrated "
                                             "drift, and the drift until the fleet calibrates it (or always, with "
                                             "quarantine_drift_floor = 0); above the noisiest honest engine pair's "
                                             "mean record score (SmolLM2 bf16 plane: <= 0.054; tiny: <= 0.004).")
    quarantine_drift_floor: float = setting(0.005, "Calibrate the CUSUM drift to quarantine_drift_factor x the "
                                                   "fleet's lag-0 record level (the median over 3+ workers of each "
                                                   "one's mean score), "
                                                   "and at least 1.75 x the trainer's own bf16 rounding level (its "
                                                   "rounding probe), between this floor and quarantine_drift "
                                                   "(stoa.trainer.fleet; docs/verification.md); 0 = no calibration.")
    quarantine_drift_factor: float = setting(2.5, "The calibrated CUSUM drift over the fleet's lag-0 level: it must "
                                                  "cover the spread between honest engines of one precision in your "
                                                  "fleet (the rounding probe covers bf16 against fp32); lower catches "
                                                  "mild lies sooner. Check a value with stoa bench verify "
                                                  "--drift-factor (its mixed-fleet table); docs/verification.md.")
    quarantine_evidence: float = setting(0.3, "CUSUM limit: quarantine once a worker's sum of (record score - "
                                              "quarantine_drift), floored at 0, passes this; a record adds at most "
                                              "quarantine_disagreement - quarantine_drift, so no single record "
                                              "can reach it.")
    quarantine_reject_rate: float = setting(0.5, "Quarantine a worker once more than this fraction of its "
                                                 "records is rejected.")
    eval_k: int = setting(1, "Multi-turn tasks: sampled episodes per held-out prompt for eval/pass@k (1 = greedy "
                             "EM and cover-EM only).")
    eval_k_final: int = setting(0, "Multi-turn tasks: sampled episodes per held-out prompt for eval/pass@k at the "
                                   "two evals a run is judged by, after the cold start and the last (0 = eval_k).")
    quarantine_min_records: int = setting(8, "Records a worker must have sent before its rates are judged.")
    preflight: bool = setting(True, "Refuse to start when the estimated peak memory per rank exceeds the device's "
                                    "(stoa.trainer.peak; the error names the knob that would fit); false: "
                                    "only report it.")
    available_memory_gb: float = setting(0.0, "Memory per rank for the preflight, in GB (0 = detect: the free "
                                              "memory of the rank's GPU, or the RAM shared by this machine's "
                                              "ranks).")
    dtype: str = setting("auto", "Compute dtype of the trainer's forward and backward: auto (bfloat16 on CUDA and "
                                 "on CPUs with native bf16, else float32), float32 or bfloat16; master weights, "
                                 "AdamW state and the log-softmax stay float32.")
    compute_weights: str = setting("bf16_copy", "How a bfloat16 trainer computes: bf16_copy runs forward and "
                                                "backward on a bf16 copy of the fp32 master weights, refreshed "
                                                "after each optimizer step (gradients land on the masters in "
                                                "fp32; less memory than autocast, docs/memory.md); autocast "
                                                "casts the masters per forward. A LoRA run and a sharded trainer "
                                                "(FSDP2 gathers bf16) always autocast; checkpoints and published "
                                                "weights are the masters either way.")
    lora_rank: int = setting(0, "Train a LoRA adapter of this rank on the frozen base instead of every weight (0 = "
                                "full fine-tuning): AdamW state and checkpoints hold the adapter only; workers get "
                                "the merged weights. Fixed when the run is created.")
    lora_alpha: float = setting(32.0, "LoRA alpha: the adapter's update is scaled by lora_alpha / lora_rank.")
    lora_targets: str = setting(LORA_TARGETS, "Modules the adapter wraps, comma-separated module-name suffixes as "
                                              "PEFT's target_modules (a TOML list also works): the attention and "
                                              "MLP projections by default.", join=",")
    lora_base_plane: str = setting("", "Hold a LoRA run's frozen base quantized (QLoRA): '' keeps it at the "
                                       "compute dtype; int8g64 or int4g64 stores every decoder-block linear as "
                                       "that weights plane's codes and bf16 group scales, its values equal to what "
                                       "a worker holds bit for bit (the plane must be the same). Needs lora_rank > "
                                       "0; one rank only. Fixed when the run is created.")
    skip_uniform_groups: bool = setting(True, "Skip groups whose rewards all agree (no advantage, so no policy "
                                              "gradient) before any forward pass; they do not count toward "
                                              "groups_per_step (rollout/skipped_uniform). False trains on them "
                                              "(KL-only gradient). GiGPO and ECHO runs keep them (their step "
                                              "advantages and echo term carry signal).")
    replay: bool = setting(True, "Replay every multi-turn record's tool calls with the trainer's own tools and "
                                 "reject a record whose observations differ. False trusts the observations "
                                 "workers recorded (a weaker trust level, counted as rollout/unreplayed): only "
                                 "for a task whose tools are not deterministic (a live web search, a stateful "
                                 "sandbox), which requires it.")
    sign_weights: str = setting("auto", "Sign the run contract and every weights pointer with the run's Ed25519 "
                                        "key so workers follow only this trainer's weights: auto (on for s3:// and "
                                        "r2:// buckets, off for a local directory), true, or false (a private "
                                        "fleet; logged). Fixed when the run is created.")
    run_key: str = setting("", "The run's private key file (default: $STOA_KEY_DIR or ~/.config/stoa/keys/"
                               "<bucket digest>-<run>.ed25519; created 0600 with a signed run, never written to "
                               "the bucket); a restarted trainer needs the same file.")
    worker_keys: str = setting("auto", "Require every record to be signed by a worker key the run key vouches for "
                                       "(stoa join-card puts one in each card; stoa worker-key issue/list/revoke; "
                                       "docs/fleet.md): auto (required in a run with a run key that is in an s3:// "
                                       "or r2:// bucket, or holds a worker identity, or required them before: "
                                       "latched beside the run key; off for the local quickstart), required, or "
                                       "off (a private fleet whose every bucket writer is trusted). Logged at "
                                       "start. Unsigned, forged, revoked or wrong-run records are refused by name.")

    cold_start: str = setting("", "Begin a new run with supervised fine-tuning before v1 is published (loss on the "
                                  "policy's own turns only): '' (none), 'demos' (demonstrations the task builds; "
                                  "search, walk and arithmetic have them), 'rft' (rejection sampling: the initial "
                                  "policy's first correct sample of cold_start_rft_samples per training prompt, "
                                  "trying at most 4x cold_start_examples prompts) or the path of a JSONL file of "
                                  "conversations ({\"messages\": [...]}, TRL's conversational format). Runs once "
                                  "per run; a restart never redoes it.")
    cold_start_steps: int = setting(32, "AdamW steps of the cold start (with cold_start set).")
    cold_start_examples: int = setting(256, "Demonstrations the cold start trains on: built by the task, kept by "
                                            "rft (at most), or the first this many of the JSONL file.")
    cold_start_rft_samples: int = setting(8, "cold_start = 'rft': samples (completions or episodes) drawn per "
                                             "training prompt at the run's temperature; the first the task scores "
                                             "correct is kept.")
    cold_start_batch: int = setting(8, "Demonstrations per cold-start step (micro-batched by micro_batch).")
    cold_start_lr: float = setting(1e-4, "AdamW learning rate of the cold start (its own optimizer; RL starts "
                                         "with fresh moments at lr); 0 = use lr.")

    def validate(self) -> TrainerConfig:
        """Raise ``ConfigError`` naming the first invalid field; return self."""
        super().validate()
        if self.plane not in PLANES:
            raise ConfigError("plane", f"{self.plane!r} is not one of {PLANES}")
        if self.plane == "int4g64" and not self.lora_rank:
            raise ConfigError("plane", "int4g64 is a LoRA run's base plane: set lora_rank > 0 or use bf16 or int8g64")
        at_least(self, 1, ("micro_batch", "anchor_every", "keep_checkpoints", "keep_versions", "reuse_cap",
                           "quarantine_min_records", "eval_k"))
        at_least(self, 0, ("eval_k_final",))
        at_least(self, 0, ("staleness_bound", "available_memory_gb", "checkpoint_every", "checkpoint_minutes"))
        one_of(self, "dtype", DTYPES)
        one_of(self, "compute_weights", COMPUTE_WEIGHTS)
        check_lora(self)
        if self.sign_weights.lower() not in ("auto", "true", "false"):
            raise ConfigError("sign_weights", f"{self.sign_weights!r} is not one of auto, true, false")
        one_of(self, "worker_keys", ("auto", "required", "off"))
        at_least(self, -1, ("keep_rollout_versions",))
        at_least(self, 1, ("metrics_flush_rows",))
        if not (self.status_seconds > 0 and self.metrics_flush_seconds > 0):
            raise ConfigError("status_seconds" if self.status_seconds <= 0 else "metrics_flush_seconds",
                              "must be > 0")
        if not self.lease_ttl_seconds > 0:
            raise ConfigError("lease_ttl_seconds", f"must be > 0, got {self.lease_ttl_seconds}")
        if self.quarantine_disagreement <= 0:
            raise ConfigError("quarantine_disagreement", "must be > 0 (turn quarantine off with quarantine = "
                                                         "false)")
        if not 0 < self.quarantine_drift < self.quarantine_disagreement:
            raise ConfigError("quarantine_drift", f"must be in (0, quarantine_disagreement = "
                                                  f"{self.quarantine_disagreement}), got {self.quarantine_drift} "
                                                  "(turn the test off with quarantine_sequential = false)")
        if not 1.0 < self.quarantine_drift_factor <= 10.0:
            raise ConfigError("quarantine_drift_factor", f"must be in (1, 10] (over 1: a worker at the fleet's level "
                                                         f"must not climb), got {self.quarantine_drift_factor}")
        if not 0 <= self.quarantine_drift_floor <= self.quarantine_drift:
            raise ConfigError("quarantine_drift_floor", f"must be in [0, quarantine_drift = {self.quarantine_drift}] "
                                                        f"(0: no calibration), got {self.quarantine_drift_floor}")
        room = self.quarantine_disagreement - (self.quarantine_drift_floor or self.quarantine_drift)
        if not room <= self.quarantine_evidence < 1e6:
            raise ConfigError("quarantine_evidence", f"must be in [quarantine_disagreement - the smallest drift = "
                                                     f"{room:.4g}, 1e6) so no single record quarantines, got "
                                                     f"{self.quarantine_evidence}")
        if not 0 < self.quarantine_reject_rate <= 1:
            raise ConfigError("quarantine_reject_rate", f"must be in (0, 1], got "
                                                        f"{self.quarantine_reject_rate}")
        self._check_cold_start()
        if self.keep_versions < self.staleness_bound + 1:
            raise ConfigError("keep_versions", f"must be >= staleness_bound + 1 = {self.staleness_bound + 1}")
        return self

    def _check_cold_start(self) -> None:
        """Raise ``ConfigError`` for cold-start settings that cannot run."""
        at_least(self, 1, ("cold_start_steps", "cold_start_examples", "cold_start_batch", "cold_start_rft_samples"))
        if not 0 <= self.cold_start_lr < 1:
            raise ConfigError("cold_start_lr", f"must be in [0, 1) (0 = use lr), got {self.cold_start_lr}")
        if self.cold_start not in ("", "demos", "rft") and not self.cold_start.endswith((".jsonl", ".json")):
            raise ConfigError("cold_start", f"{self.cold_start!r} is not '', 'demos', 'rft' or a .jsonl file of "
                                            "conversations; give one of those")
