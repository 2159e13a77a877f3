"""A trainer step's metrics row and progress line (``train/*`` and ``rollout/*``)."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import numpy as np

from stoa.layout import rollout_label
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


def step_line(row: dict[str, Any], step: int) -> str:
    """The progress line of a step's row.

    Args:
        row: ``step_row``'s row.
        step: the run's step count after this step.
    """
    search = f" | search {row['rollout/search_rate']:.2f}" if "rollout/search_rate" in row else ""
    skipped = f", {row['rollout/skipped_uniform']} uniform skipped" if row.get("rollout/skipped_uniform") else ""
    return (f"[trainer] step {step} -> v{row['version']} | reward {row['rollout/reward_mean']:.3f}{search} | "
            f"loss {row['train/loss']:+.4f} | kl {row.get('train/kl', 0.0):.2e} | {row['train/step_time_s']:.1f}s "
            f"({row['train/tokens_per_s']:.0f} tok/s) | lag {row['rollout/lag_mean']:.1f} | records "
            f"{row['rollout/records_per_s']:.2f}/s, sampled {row['rollout/sampled_tokens_per_s']:.0f} tok/s{skipped}")
