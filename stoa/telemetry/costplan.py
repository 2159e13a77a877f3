"""The dry run's bucket-cost estimate: a run's requests and storage from its settings and a fleet size.

A model of what the trainer and its workers ask of the bucket (each figure is an assumption, named in
:class:`CostEstimate`; measured against a real run in docs/fleet.md):

- per step, the trainer lists the window twice (its loop and the intake during the step: one LIST per
  version, ``staleness_bound + 1``), reads ``groups_per_step`` records, writes the journal, the status, the
  pointer and two lease renewals, uploads one patch (an anchor every ``anchor_every`` versions: its file and
  manifest), deletes one old patch and one old rollout version (retention: LIST + DeleteObjects), and a metrics
  chunk every ``metrics_flush_rows`` steps;
- the workers write the ``groups_per_step`` records the step trains on (one PUT each), and each worker reads
  the pointer and the new patch once per version;
- per hour, the trainer renews its status every ``status_seconds`` and its lease every third of its TTL, each
  worker uploads a metrics chunk a minute and, while it polls (paused or waiting), reads the status and the
  pointer every worker ``status_seconds`` (0.5 s): ``polling_share`` of its time;
- a checkpoint every ``checkpoint_every`` steps and/or ``checkpoint_minutes``: 12 bytes per parameter in
  16 MiB multipart parts;
- uploads over 64 MiB are multipart (16 MiB parts), a patch is ``patch_share`` of the full weights
  (:data:`PATCH_SHARE`: docs/weights.md measured 0.97% for SmolLM2-135M in bf16 at lr 1e-6; more at higher lr);
- a LoRA run (``adapter_params``) publishes its base once and then adapter versions (bf16, a patch
  :data:`ADAPTER_PATCH_SHARE` of the adapter), and its checkpoints hold the adapter and its AdamW moments only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from stoa.bucket.meter import PART_SIZE, Counts
from stoa.telemetry.cost import PRICES_SOURCE, Prices, storage_usd

__all__ = ["CostEstimate", "estimate_cost", "estimate_lines"]

PLANE_BYTES = {"bf16": 2.0, "int8g64": 1.0625}
"""Published bytes per parameter of each weights plane (int8 plus one bf16 scale per 64)."""
WORKER_STATUS_SECONDS = 0.5
"""A worker's default ``status_seconds``: how often a polling worker reads the status (and the pointer)."""
WORKER_METRICS_PER_HOUR = 60.0
"""A worker uploads its metrics rows as a chunk at least once a minute."""
CHECKPOINT_BYTES_PER_PARAM = 12
PATCH_SHARE = 0.02
"""A patch's size as a share of the full weights (twice what docs/weights.md measured at lr 1e-6)."""
ADAPTER_PATCH_SHARE = 0.4
"""An adapter patch's size as a share of the adapter (SmolLM2-135M, rank 16, lr 1e-4: median 3.6 MB of 9.8 MB)."""


def _puts(nbytes: float) -> int:
    """Class-A requests of one upload: one PUT up to 64 MiB, else create + 16 MiB parts + complete."""
    return 1 if nbytes <= 4 * PART_SIZE else math.ceil(nbytes / PART_SIZE) + 2


@dataclass(frozen=True)
class CostEstimate:
    """Requests per step and per hour, and bytes stored, of a run (see the module doc for the model).

    Attributes:
        fleet: workers.
        trainer_step: the trainer's requests per step.
        workers_step: all workers' requests per step (records, one pointer and patch read each per version).
        trainer_hour: the trainer's requests per hour besides steps (status and lease heartbeats).
        workers_hour: all workers' requests per hour besides steps (metrics chunks, polling).
        checkpoint: the requests of one checkpoint (amortised over ``checkpoint_every`` steps in ``per_step``).
        stored_bytes: bytes the run keeps (weights versions, checkpoints, the rollout window).
        tokens_per_step: trained tokens per step (at most ``groups_per_step x n_samples x max_new_tokens``).
        polling_share: the share of a worker's time it spends polling (paused or waiting on weights).
    """

    fleet: int
    trainer_step: Counts
    workers_step: Counts
    trainer_hour: Counts
    workers_hour: Counts
    checkpoint: Counts
    checkpoint_every: int
    checkpoint_minutes: float
    stored_bytes: float
    tokens_per_step: float
    polling_share: float

    def per_step(self) -> Counts:
        """Requests per step (checkpoints apart)."""
        return self.trainer_step + self.workers_step

    def checkpoints_per_hour(self, step_seconds: float) -> float:
        """Checkpoints per hour by steps and by minutes (as ``stoa.trainer.cadence.per_hour``)."""
        steps = 3600.0 / step_seconds
        by_steps = steps / self.checkpoint_every if self.checkpoint_every else 0.0
        by_time = min(60.0 / self.checkpoint_minutes, steps) if self.checkpoint_minutes else 0.0
        return min(steps, by_steps + by_time)

    def usd_per_hour(self, step_seconds: float, prices: Prices) -> float:
        """Requests and storage per hour at ``step_seconds`` per step."""
        steps, c, ck = 3600.0 / step_seconds, self.per_step(), self.checkpoints_per_hour(step_seconds)
        per_hour = (Counts(round(c.a * steps + self.checkpoint.a * ck), round(c.b * steps)) + self.trainer_hour
                    + self.workers_hour)
        return prices.requests_usd(per_hour) + storage_usd(self.stored_bytes, 1.0, prices)


def estimate_cost(cfg: Any, fleet: int, params: float | None, *, patch_share: float = PATCH_SHARE,
                  polling_share: float = 0.2, adapter_params: float | None = None) -> CostEstimate:
    """Estimate a run's bucket requests and storage.

    Args:
        cfg: the trainer config (``staleness_bound``, ``groups_per_step``, ``n_samples``, ``max_new_tokens``,
            ``anchor_every``, ``keep_versions``, ``checkpoint_every``, ``keep_checkpoints``, ``status_seconds``,
            ``lease_ttl_seconds``, ``metrics_flush_rows``, ``plane``).
        fleet: workers (>= 1).
        params: the model's parameter count (None: unknown; weights count as one small object).
        patch_share: a patch's size as a share of the full weights.
        polling_share: the share of each worker's time spent polling.
        adapter_params: a LoRA run's adapter parameters (None: full fine-tuning); its versions are the adapter
            in bf16 (patches :data:`ADAPTER_PATCH_SHARE` of it), the base is stored once, checkpoints hold the
            adapter only.
    """
    if fleet < 1:
        raise ValueError(f"fleet size must be >= 1, got {fleet}; pass --fleet-size N")
    s, g = cfg.staleness_bound, cfg.groups_per_step
    base = (params or 0) * PLANE_BYTES.get(cfg.plane, 2.0)
    full, trained, stored_base = base, params, 0.0
    if adapter_params is not None:  # versions of the adapter only; the base goes up once
        full, trained, stored_base, patch_share = 2.0 * adapter_params, adapter_params, base, ADAPTER_PATCH_SHARE
    anchor, patch = _puts(full) + 1, _puts(full * patch_share)
    weights_a = (anchor + (cfg.anchor_every - 1) * patch) / cfg.anchor_every
    gc_a = 1 + 3 / cfg.anchor_every  # one patch deleted; an old anchor: manifest, LIST, DeleteObjects
    trainer_a = 2 * (s + 1) + 5 + weights_a + gc_a + 2 + 1 / cfg.metrics_flush_rows
    trainer_step = Counts(math.ceil(trainer_a), g)
    workers_step = Counts(g, 2 * fleet)
    ck_bytes = (trained or 0) * CHECKPOINT_BYTES_PER_PARAM
    checkpoint = Counts(_puts(ck_bytes) + 4, 0)  # data + metadata files, pointer, LIST + DeleteObjects of the old
    trainer_hour = Counts(round(3600 / cfg.status_seconds + 3 * 3600 / cfg.lease_ttl_seconds), 0)
    workers_hour = Counts(round(fleet * WORKER_METRICS_PER_HOUR),
                          round(fleet * polling_share * 2 * 3600 / WORKER_STATUS_SECONDS))
    stored = (stored_base + full * (cfg.keep_versions * patch_share + 1) + ck_bytes * cfg.keep_checkpoints
              + (s + 1) * g * cfg.n_samples * cfg.max_new_tokens * 12)  # ~12 bytes per sampled token stored
    return CostEstimate(fleet, trainer_step, workers_step, trainer_hour, workers_hour, checkpoint,
                        cfg.checkpoint_every, cfg.checkpoint_minutes, stored,
                        float(g * cfg.n_samples * cfg.max_new_tokens), polling_share)


def estimate_lines(e: CostEstimate, prices: Prices, step_seconds: tuple[float, ...] = (10.0, 60.0)) -> list[str]:
    """The dry run's bucket-cost section.

    Args:
        e: the estimate.
        prices: the price list.
        step_seconds: step times to show the hourly figures at.
    """
    c = e.per_step()
    step_usd = prices.requests_usd(c)
    lines = [f"# bucket cost, estimated for {e.fleet} worker(s) at {PRICES_SOURCE}: "
             f"A ${prices.class_a_per_million:g}/M, B ${prices.class_b_per_million:g}/M, "
             f"storage ${prices.storage_per_gb_month:g}/GB-month",
             f"# per step: {c.a} class A (trainer {e.trainer_step.a}, workers' records {e.workers_step.a}), "
             f"{c.b} class B (records {e.trainer_step.b}, {e.workers_step.b} pointer and patch reads) = "
             f"${step_usd:.3g}; per trained token ${step_usd / e.tokens_per_step:.3g} "
             f"(at most {e.tokens_per_step:.0f} tokens per step)",
             f"# per checkpoint: {e.checkpoint.a} class A (multipart parts of 12 B per parameter)",
             f"# per hour besides steps: {e.trainer_hour.a + e.workers_hour.a} class A (status and lease heartbeats, "
             f"workers' metrics), {e.workers_hour.b} class B (workers polling {e.polling_share:.0%} of the time)",
             f"# stored: {e.stored_bytes / 1e9:.3f} GB (weights kept, checkpoints, rollout window) = "
             f"${storage_usd(e.stored_bytes, 1.0, prices):.3g}/hour"]
    lines.append("# per hour = " + ", ".join(f"${e.usd_per_hour(s, prices):.3g} at {s:g} s/step" for s in step_seconds))
    return lines
