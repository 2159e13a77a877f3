"""The one-line-per-attack verdict of ``stoa bench verify``: which check catches each attack first, whether it is
caught, and how soon (records or steps). Joins the CUSUM rows (``stats.AttackRow``), the per-step rows
(``steps.StepRow``) and the intake rows (``intake.IntakeRow``). Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from stoa.bench.verify.intake import IntakeRow
from stoa.bench.verify.stats import AttackRow
from stoa.bench.verify.steps import StepRow
from stoa.trainer.sequential import CusumParams


@dataclass(frozen=True)
class Verdict:
    """One attack's verdict.

    Args:
        attack: label.
        detector: the check that catches it first (or what neutralises it, or ``none``).
        detected: ``yes``, ``no``, ``neutralised`` (it trains nothing it claims) or ``partly``.
        when: records or steps to detect.
    """

    attack: str
    detector: str
    detected: str
    when: str


def logprob_verdict(cusum: AttackRow, step: StepRow | None, params: CusumParams) -> Verdict:
    """An attack seen in the logprobs: the recompute check if it drops most records, else the sooner of quarantine
    with the trainer's defaults (its records to quarantine) and the CUSUM of ``params`` (its median records)."""
    if step is not None and step.dropped * 2 > step.records:
        return Verdict(cusum.attack, "recompute check (per sample)", "yes",
                       f"record 1, in its step ({step.dropped}/{step.records} records dropped)")
    test = f"CUSUM (drift {params.drift:.3g}, limit {params.limit:.3g})"
    found = []
    if step is not None and step.reason:
        found.append((float(step.quarantined_after), Verdict(cusum.attack, f"quarantine `{step.reason}` (defaults)",
                                                             "yes", f"{step.quarantined_after} records, step "
                                                                    f"{step.steps}")))
    if cusum.detected == cusum.streams and cusum.streams:
        found.append((cusum.median_records, Verdict(cusum.attack, test, "yes", f"median {cusum.median_records:g} "
                                                                               f"records (max {cusum.max_records})")))
    if found:
        return min(found, key=lambda f: f[0])[1]
    if cusum.detected:
        return Verdict(cusum.attack, test, "partly", f"{cusum.detected}/{cusum.streams} streams within "
                                                     f"{cusum.records} records")
    return Verdict(cusum.attack, "none", "no", f"not within {cusum.records} records")


def intake_verdict(r: IntakeRow) -> Verdict:
    """An intake attack: rejected (record 1), neutralised (trained, but with what the trainer computed) or not."""
    if r.attack.startswith("control"):
        return Verdict(r.attack, "-", "accepted" if r.trained == r.written else "REJECTED (a false positive)", "-")
    if r.rejected == r.written and r.written:
        return Verdict(r.attack, f"intake: `{r.detector.split(' x')[0]}`", "yes", "record 1 (never trained)")
    if r.detector.startswith("reward re-scored"):
        return Verdict(r.attack, "reward re-scoring", "neutralised", "record 1 (trained with the verifier's reward)")
    return Verdict(r.attack, "none", "no", f"{r.trained}/{r.written} trained: {r.note}")


def table(rows: list[Verdict]) -> list[str]:
    """Markdown table of the verdicts."""
    lines = ["| attack | detector | detected | time to detect |", "| --- | --- | --- | --- |"]
    lines += [f"| {r.attack} | {r.detector} | {r.detected} | {r.when} |" for r in rows]
    return lines
