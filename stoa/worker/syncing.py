"""The worker's weights: adopt the newest verified version, or keep sampling with the held one while it is
usable; one log line and metrics row per refused object."""

from __future__ import annotations

import time
from datetime import datetime

from stoa.config import WorkerConfig
from stoa.contract import RunContract
from stoa.telemetry.metrics import MetricsWriter


def published_at(sync) -> float | None:
    """Unix time the trainer published the version this worker just adopted (from the pointer)."""

    p = getattr(sync, "pointer", None)
    try:
        return datetime.fromisoformat(p.updated_at).timestamp() if p is not None else None
    except (AttributeError, TypeError, ValueError):
        return None


def sync_weights(follower, engine, contract: RunContract, cfg: WorkerConfig, echo, metrics: MetricsWriter,
          current: int | None) -> int:
    """Adopt the newest verified weights, or keep the held ones while they stay usable.

    Never exits over a refused object or an unusable pointer: the held weights keep sampling while at
    most the contract's ``staleness_bound`` versions behind; beyond that (or before the first version)
    this waits, retrying with the follower's jittered backoff, until a sync succeeds. Only a run that
    publishes no pointer at all within ``wait_seconds`` raises TimeoutError.
    """
    deadline = time.monotonic() + cfg.wait_seconds
    paused_at: float | None = None
    while True:
        step = follower.step()
        _report_sync(step, follower, current, echo, metrics)
        if step.adopted is not None:
            version, state = step.adopted
            _load(engine, state, contract.weight_plane)
            m = follower.sync.metrics
            metrics.log({"worker/version": version, "worker/sync_bytes": m["bytes"],
                         "worker/sync_s": m["seconds"], "worker/sync_path": m["path"],
                         "worker/sync_versions_applied": m["versions_applied"], "worker/paused": 0})
            echo(f"[worker] now at v{version} ({m['path']}, {m['bytes'] / 1e6:.2f} MB in "
                 f"{m['seconds']:.2f}s)")
            return version
        if step.usable and current is not None:
            return current
        if step.target is None and step.error is None:  # nothing published yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {contract.run_id!r} published no weights within "
                                   f"{cfg.wait_seconds:.0f}s")
        elif paused_at is None:
            paused_at = time.monotonic()
            held = (f"v{current} is {step.target - current} versions behind the pointer (v{step.target})"
                    if current is not None and step.target is not None else "no verified weights yet")
            echo(f"[worker] paused: {held}; not sampling until a sync succeeds")
            metrics.log({"worker/paused": 1, "worker/version": current})
        time.sleep(step.retry_in or cfg.poll_seconds)


def _load(engine, state, plane: str) -> None:
    """Load verified stored bits into the engine (a LoRA run's: the adapter tensors, plane ``adapter``)."""
    engine.load_state(state, plane)


def _report_sync(step, follower, current: int | None, echo, metrics: MetricsWriter) -> None:
    """One log line and one metrics row per refused object; one line for a failure without one.

    ``worker/sync_refused`` counts refusals since start, ``worker/sync_error`` is the reason and
    ``worker/sync_key`` the object.
    """
    keeping = f"keeping v{current}" if current is not None else "no weights yet"
    before = follower.refused_total - len(step.refusals)
    for i, r in enumerate(step.refusals, start=1):
        echo(f"[worker] refused {r.key}: {r.reason} ({r.detail[:200]}) [{r.plan}]; "
             + ("fell back" if step.adopted is not None else keeping))
        metrics.log({"worker/sync_refused": before + i, "worker/sync_error": r.reason,
                     "worker/sync_key": r.key, "worker/version": current})
    if step.error is not None and not step.refusals:
        echo(f"[worker] weight sync failed ({step.error}); {keeping}, retrying in {step.retry_in:.0f}s")
        metrics.log({"worker/sync_error": step.error.reason, "worker/version": current})
