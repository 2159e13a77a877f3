"""The per-sample recompute check: a lag-0 group with a sample whose recorded logprobs are far from the trainer's
is not trained (``rollout/rejected/recompute``).

At lag 0 the trainer's logprobs of a record's action tokens differ from the worker's recorded ones only by
engine and weight-plane rounding (``stoa.trainer.quarantine``, whose per-token statistic this reuses:
``exp|recorded - recomputed| - 1``). Quarantine judges a worker by the median over many records; this check
judges each sample by the median over its own action tokens, so one forged sample (text the policy did not
sample, with logprobs made up for it) is caught in the step it would train in. Its group is dropped whole: the
group's other advantages were computed against the forged sample's reward.

``RECOMPUTE_LIMIT`` sits far above what honest engines produce (``stoa bench quarantine`` and
docs/architecture.md give the measured figures), and scales with the run's temperature and nucleus exactly
like quarantine's threshold (``effective_threshold``). Lagged samples are not judged: their recorded logprobs
are an older policy's, which the algorithm's ratio, clip and gate are for. This module imports no torch.
"""

from __future__ import annotations

import numpy as np

from stoa.trainer.quarantine import disagreement_values, effective_threshold

__all__ = ["RECOMPUTE_LIMIT", "RecomputeCheck", "sample_medians"]

RECOMPUTE_LIMIT = 3.0
"""Largest median ``exp|recorded - recomputed| - 1`` over a lag-0 sample's action tokens, at temperature 1 and
top_p 1 (a median ``|recorded - recomputed|`` of ln 4 = 1.39 nats a token). Honest torch engines measured at most
0.27 per sample on SmolLM2-135M (bf16 engine, int8g64 plane) and 0.94 on any single token."""


def sample_medians(recorded: np.ndarray, recomputed: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Per row, the median ``exp|recorded - recomputed| - 1`` over its masked tokens (float64 [b]).

    A row without masked tokens gives 0; a non-finite value (a recompute that overflowed) counts as infinite.

    Args:
        recorded: [b, T] the workers' logprobs.
        recomputed: [b, T] the trainer's logprobs of the same tokens.
        mask: [b, T] 1 on the tokens to judge (the action tokens).
    """
    values = disagreement_values(recorded, recomputed)
    values = np.where(np.isfinite(values), values, np.inf)
    out = np.zeros(values.shape[0], np.float64)
    for i in range(values.shape[0]):
        row = values[i][np.asarray(mask[i]) > 0]
        if row.size:
            out[i] = float(np.median(row))
    return out


class RecomputeCheck:
    """The groups of one step whose lag-0 samples fail the check.

    Args:
        group_ids: [B] the group of each row of the step's batch.
        version_lag: [B] each row's version lag (only lag 0 is judged).
        temperature: the run's sampling temperature.
        top_p: the run's nucleus mass.
        limit: the limit at temperature 1 and top_p 1 (None: ``RECOMPUTE_LIMIT``; ``inf`` judges nothing).
    """

    def __init__(self, group_ids: np.ndarray, version_lag: np.ndarray, *, temperature: float = 1.0,
                 top_p: float = 1.0, limit: float | None = None):
        self.group_ids, self.version_lag = np.asarray(group_ids), np.asarray(version_lag)
        base = RECOMPUTE_LIMIT if limit is None else float(limit)
        self.limit = effective_threshold(base, temperature, top_p) if np.isfinite(base) else np.inf
        self.rejected: set[int] = set()
        """Groups (``group_ids`` values) with a sample over the limit."""
        self.worst = 0.0
        """The largest lag-0 sample median judged."""
        self.residual: dict[int, float] = {}
        """Per group (``group_ids`` value) with a lag-0 sample: its largest sample median (provenance)."""

    def judge(self, rows: np.ndarray, recorded: np.ndarray, recomputed: np.ndarray, mask: np.ndarray) -> None:
        """Judge some rows of the batch; their groups join ``rejected`` when a lag-0 sample is over the limit.

        Args:
            rows: [b] the rows' indices in the batch.
            recorded: [b, T] their recorded logprobs.
            recomputed: [b, T] the trainer's logprobs.
            mask: [b, T] their action masks.
        """
        lag0 = self.version_lag[rows] == 0
        if not lag0.any():
            return
        med = sample_medians(recorded[lag0], recomputed[lag0], mask[lag0])
        self.worst = max(self.worst, float(med.max()))
        for g, v in zip(self.group_ids[rows[lag0]], med, strict=True):
            self.residual[int(g)] = max(self.residual.get(int(g), 0.0), float(v))
        self.rejected.update(int(g) for g in self.group_ids[rows[lag0]][med > self.limit])

    def keep(self, rows: np.ndarray) -> np.ndarray:
        """[b] float32: 0 for the rows of rejected groups, 1 for the others.

        Args:
            rows: row indices of the batch.
        """
        return np.array([0.0 if int(g) in self.rejected else 1.0 for g in self.group_ids[rows]], np.float32)
