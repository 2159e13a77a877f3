"""A liar's records judged by the trainer's own per-step checks, as ``stoa.trainer.step`` and ``stoa.trainer.loop``
feed them: the per-sample recompute check (``RecomputeCheck``: a lag-0 sample whose median ``exp|d| - 1`` is over
``RECOMPUTE_LIMIT`` drops its group in the step it arrives) and quarantine with the trainer's default settings
(``Quarantine``: the per-step median threshold and the CUSUM), fed ``--records-per-step`` of the liar's lag-0
records a step. The inputs are each sample's ``d = recorded - recomputed`` logprobs (``Rig.residuals``). Imports no
torch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stoa.config import TrainerConfig
from stoa.trainer.quarantine import Disagreement, Quarantine, disagreement_values
from stoa.trainer.recompute_check import RecomputeCheck

Residuals = list[list[np.ndarray]]
"""Per record, per sample: ``recorded - recomputed`` logprob of each token."""


@dataclass(frozen=True)
class StepRow:
    """One attack's records through the trainer's per-step checks.

    Args:
        attack: label.
        records: the liar's records judged.
        dropped: records whose group the recompute check drops (never trained).
        first_dropped: 1-based index of the first dropped record (0: none).
        reason: the reason quarantine (trainer defaults) gave ("": never quarantined).
        quarantined_after: the liar's records fed when it was quarantined (0: never).
        steps: trainer steps fed when it was quarantined (0: never).
    """

    attack: str
    records: int
    dropped: int
    first_dropped: int
    reason: str
    quarantined_after: int
    steps: int


def values(d: np.ndarray) -> np.ndarray:
    """The trainer's per-token ``exp|recorded - recomputed| - 1`` of residuals ``d = recorded - recomputed``."""
    return disagreement_values(d, np.zeros_like(d))


def step_row(attack: str, records: Residuals, per_step: int, temperature: float,
             cfg: TrainerConfig | None = None) -> StepRow:
    """Feed ``records`` in order, ``per_step`` a step, to the trainer's recompute check and a fresh ``Quarantine``.

    Args:
        attack: label.
        records: the liar's residuals (``Rig.residuals``).
        per_step: the liar's lag-0 records in each trainer step.
        temperature: the run's temperature (scales both checks' limits like the trainer's).
        cfg: the trainer settings (None: the defaults).
    """
    cfg = cfg or TrainerConfig()
    drops = _dropped(records, temperature)
    q = Quarantine(enabled=True, disagreement=cfg.quarantine_disagreement, reject_rate=cfg.quarantine_reject_rate,
                   min_records=cfg.quarantine_min_records, temperature=temperature,
                   drift=cfg.quarantine_drift if cfg.quarantine_sequential else None,
                   evidence=cfg.quarantine_evidence)
    reason, after, steps = "", 0, 0
    for step, start in enumerate(range(0, len(records), per_step), 1):
        part = records[start:start + per_step]
        per_record = tuple(values(np.concatenate(r)) for r in part)
        q.observe_disagreement("liar", Disagreement(np.concatenate(per_record), len(part), per_record))
        if q.is_quarantined("liar"):
            reason, after, steps = q.workers["liar"].reason, start + len(part), step
            break
    hits = np.flatnonzero(drops)
    return StepRow(attack, len(records), int(drops.sum()), int(hits[0]) + 1 if hits.size else 0, reason, after,
                   steps)


def _dropped(records: Residuals, temperature: float) -> np.ndarray:
    """[records] bool: whether the trainer's recompute check drops each record's group (its samples judged at lag
    0 as one step's rows)."""
    lengths = [len(d) for r in records for d in r]
    width = max(lengths, default=1)
    recorded = np.zeros((len(lengths), width), np.float64)
    mask = np.zeros_like(recorded)
    group_ids = np.repeat(np.arange(len(records)), [len(r) for r in records])
    for i, d in enumerate(d for r in records for d in r):
        recorded[i, :len(d)], mask[i, :len(d)] = d, 1.0
    check = RecomputeCheck(group_ids, np.zeros(len(lengths), np.int64), temperature=temperature)
    check.judge(np.arange(len(lengths)), recorded, np.zeros_like(recorded), mask)
    return np.array([g in check.rejected for g in range(len(records))])


def flatten(records: Residuals) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The arrays ``--save-scores`` stores: every token's residual, each sample's length, each record's samples."""
    flat = [d for r in records for d in r]
    return (np.concatenate(flat) if flat else np.zeros(0), np.array([len(d) for d in flat], np.int64),
            np.array([len(r) for r in records], np.int64))


def unflatten(values: np.ndarray, lengths: np.ndarray, samples: np.ndarray) -> Residuals:
    """``flatten``'s inverse."""
    cuts = np.cumsum(lengths)[:-1]
    flat = np.split(np.asarray(values, np.float64), cuts) if lengths.size else []
    out, k = [], 0
    for n in samples:
        out.append(flat[k:k + int(n)])
        k += int(n)
    return out


def table(rows: list[StepRow], per_step: int) -> list[str]:
    """Markdown table of the rows."""
    lines = [f"| attack | recompute check: records dropped | first dropped | quarantine (defaults, {per_step} "
             "records a step) | liar records / steps to quarantine |", "| --- | ---: | ---: | --- | ---: |"]
    lines += [f"| {r.attack} | {r.dropped}/{r.records} | {r.first_dropped or '-'} | {r.reason or 'not quarantined'} "
              f"| {f'{r.quarantined_after} / {r.steps}' if r.steps else '-'} |" for r in rows]
    return lines
