"""A trainer step's metrics row and progress line (``train/*`` and ``rollout/*``)."""

from __future__ import annotations

import collections
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from stoa.layout import rollout_label
from stoa.lifecycle import age
from stoa.trainer.pool import Entry, PoolStats
from stoa.trainer.setup import reward_stats
from stoa.trainer.step import episode_figures


def step_row(entries: Sequence[Entry], m: dict[str, float], ps: PoolStats, *, version: int, staleness_bound: int,
             since_s: float, publish: Any = None, publish_s: float = 0.0, deleted: int = 0) -> dict[str, Any]:
    """The metrics row of the step that produced ``version``.

    Args:
        entries: the step's groups.
        m: ``train_step``'s metrics (without the ``train/`` prefix).
        ps: the pool's counters since the last step (the intake that ran during this step included).
        version: the version this step produced.
        staleness_bound: the run's window (one ``rollout/staleness/<lag>`` count per lag).
        since_s: seconds since the previous step's row.
        publish: the ``PublishResult`` of the version uploaded while this step computed (``bytes_patch``), if any.
        publish_s: that upload's seconds.
        deleted: rollout objects retention deleted after this step.
    """
    rewards = np.stack([e.rewards for e in entries])
    lags = np.array([version - 1 - e.record.policy_version for e in entries])
    row: dict[str, Any] = {f"train/{k}": v for k, v in m.items()}
    row.update({f"rollout/{k}": v for k, v in reward_stats(rewards).items()})
    row.update({"version": version, "train/publish_s": publish_s,
                "train/patch_bytes": float(getattr(publish, "bytes_patch", 0)),
                "rollout/accepted": ps.accepted, "rollout/records_per_s": ps.accepted / since_s,
                "rollout/sampled_tokens_per_s": ps.tokens / since_s, "rollout/dropped_stale": ps.dropped_stale,
                "rollout/reward_mismatch": ps.reward_mismatch, "rollout/lag_mean": float(lags.mean()),
                "rollout/lag_max": int(lags.max()),
                "rollout/reuse_mean": float(np.mean([e.uses for e in entries]))})
    rejected = ps.rejected + collections.Counter(getattr(m, "rejected", {}))  # the step's own (recompute)
    row.update({f"rollout/rejected/{k}": v for k, v in rejected.items()})
    row["rollout/filtered"] = ps.filtered
    row["rollout/skipped_uniform"] = ps.skipped_uniform
    row["rollout/deleted_objects"] = deleted
    row["rollout/keys"] = [rollout_label(e.key) for e in entries]
    for lag in range(staleness_bound + 1):
        row[f"rollout/staleness/{lag}"] = int((lags == lag).sum())
    row.update(episode_figures(list(entries), ps, m["step_time_s"]))
    return row


RATE_STEPS = 10
"""Steps the rate and ETA of a step line are measured over (this process's most recent ones)."""


class Progress(NamedTuple):
    """Where a run stands after a step.

    Args:
        step: the run's steps so far (restarts included).
        total: the run's total steps (0: unbounded, no ETA).
        per_min: steps per minute over this process's recent steps, waits included (None: not measured yet).
        eta_s: seconds to the total at that rate (None: unbounded or not measured yet).
    """

    step: int
    total: int
    per_min: float | None = None
    eta_s: float | None = None

    def text(self) -> str:
        """``step 3/30 (5.2 steps/min, ETA 5m10s)``; ``step 3`` alone for an unbounded run without a rate."""
        head = f"step {self.step}/{self.total}" if self.total else f"step {self.step}"
        parts = ([f"{self.per_min:.1f} steps/min"] if self.per_min is not None else []) + (
            [f"ETA {age(self.eta_s)}"] if self.eta_s is not None else [])
        return f"{head} ({', '.join(parts)})" if parts else head


class StepClock:
    """The rate and ETA of a trainer's steps, measured over its last ``window`` steps (waits included).

    Args:
        total: the run's total steps (0: unbounded).
        step: the run's step count when this process starts stepping (a resumed run's steps are not timed).
        window: steps the rate is measured over.
        clock: monotonic clock (tests pass a fake one).
    """

    def __init__(self, total: int, step: int, window: int = RATE_STEPS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self._clock = total, clock
        self._marks: deque[tuple[int, float]] = deque([(step, clock())], maxlen=window + 1)

    def tick(self, step: int) -> Progress:
        """Record that the run reached ``step`` now; return its progress.

        Args:
            step: the run's step count after this step.
        """
        self._marks.append((step, self._clock()))
        (s0, t0), (s1, t1) = self._marks[0], self._marks[-1]
        if s1 <= s0 or t1 <= t0:
            return Progress(step, self.total)
        per_min = 60.0 * (s1 - s0) / (t1 - t0)
        eta = 60.0 * max(0, self.total - step) / per_min if self.total else None
        return Progress(step, self.total, per_min, eta)


def step_line(row: dict[str, Any], progress: Progress) -> str:
    """The progress line of a step's row.

    Args:
        row: ``step_row``'s row.
        progress: the run's step count after this step, its total, rate and ETA (``StepClock.tick``).
    """
    search = f" | search {row['rollout/search_rate']:.2f}" if "rollout/search_rate" in row else ""
    skipped = f", {row['rollout/skipped_uniform']} uniform skipped" if row.get("rollout/skipped_uniform") else ""
    return (f"[trainer] {progress.text()} -> v{row['version']} | reward {row['rollout/reward_mean']:.3f}{search} | "
            f"loss {row['train/loss']:+.4f} | kl {row.get('train/kl', 0.0):.2e} | {row['train/step_time_s']:.1f}s "
            f"({row['train/tokens_per_s']:.0f} tok/s) | lag {row['rollout/lag_mean']:.1f} | records "
            f"{row['rollout/records_per_s']:.2f}/s, sampled {row['rollout/sampled_tokens_per_s']:.0f} tok/s{skipped}")
