"""Each step's provenance: which worker's records the step trained on, at what version and lag, and the trainer's
verdicts on them (``stoa.schemas.provenance``), written create-only after the step's version is published.

Nothing here is on the path of correctness: the rows are built from what the step already knows (the pool's
entries, the recompute check's residuals), and a write that fails is logged and counted
(``train/provenance_unwritten``), never raised: training goes on without it. This module imports no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from stoa.bucket import Bucket
from stoa.layout import provenance_key, rollout_label
from stoa.schemas.provenance import UNSIGNED, ProvenanceRow, encode_rows
from stoa.trainer.pool import Entry

log = logging.getLogger(__name__)


def signature_verdict(e: Entry) -> str:
    """The signature verdict of an entry: ``signed <key prefix>`` when the intake verified a worker key's
    signature on it (``e.signer``), else ``UNSIGNED`` (a run without worker keys)."""
    return f"signed {e.signer[:16]}" if e.signer else UNSIGNED


def step_provenance(entries: Sequence[Entry], checks: Mapping[int, Any], *, step: int, version: int,
                    replay: bool, worker_of: Callable[[Entry], str]) -> list[ProvenanceRow]:
    """The rows of one step, one per entry, in the step's order.

    Args:
        entries: the step's groups.
        checks: per entry index, its recompute verdict (``StepMetrics.groups``: ``residual``, ``rejected``);
            lag-0 groups only.
        step: the run's step count after this step.
        version: the trainer's version the step trained (the lag is measured from it).
        replay: whether the pool replays multi-turn records (``replay = true``).
        worker_of: the worker an entry is charged to (``stoa.trainer.step.entry_worker``).
    """
    rows = []
    for i, e in enumerate(entries):
        check = checks.get(i)
        if e.replayed is None:
            replayed, calls = "-", 0
        else:
            replayed, calls = ("ok" if replay else "unreplayed"), sum(r.calls for r in e.replayed)
        rows.append(ProvenanceRow(
            step=step, record=rollout_label(e.key), worker=worker_of(e), version=e.record.policy_version,
            lag=version - e.record.policy_version, replay=replayed, tool_calls=calls,
            recompute="lagged" if check is None else ("rejected" if check.rejected else "ok"),
            residual=None if check is None else float(check.residual), signature=signature_verdict(e)))
    return rows


class ProvenanceWriter:
    """Holds each step's rows until its version is published, then writes them (one create-only object a step).

    Args:
        bucket: the run's bucket (the trainer's fenced one).
        run_id: the run.
        echo: where a failed write is reported.
    """

    def __init__(self, bucket: Bucket, run_id: str, echo: Callable[[str], Any] = print) -> None:
        self.bucket, self.run_id, self.echo = bucket, run_id, echo
        self.pending: list[tuple[int, bytes]] = []
        self.written = 0
        self.failed = 0
        """Steps whose provenance could not be written (``train/provenance_unwritten``)."""

    def add(self, step: int, rows: list[ProvenanceRow]) -> None:
        """Hold a step's rows until ``flush``.

        Args:
            step: the run's step.
            rows: its rows (``step_provenance``).
        """
        self.pending.append((step, encode_rows(rows)))

    def flush(self) -> None:
        """Write every held step; a failure (bucket error, an object already there, a lost lease) is reported and
        counted, never raised."""
        pending, self.pending = self.pending, []
        for step, data in pending:
            try:
                self.bucket.put_create(provenance_key(self.run_id, step), data)
                self.written += 1
            except Exception as e:  # noqa: BLE001 - provenance never stops training
                self.failed += 1
                log.warning("provenance of step %d not written: %s", step, e)
                self.echo(f"[trainer] provenance of step {step} not written ({type(e).__name__}: {str(e)[:200]}); "
                          f"{self.failed} step(s) unwritten so far, training goes on")
