"""The figures of ``stoa bench verify``: false quarantines of honest streams with a one-sided 95% Clopper-Pearson
bound, and records-to-detect of attack streams. Imports no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from stoa.trainer.sequential import CusumParams, run_length


def upper_bound(events: int, trials: int, confidence: float = 0.95) -> float:
    """One-sided Clopper-Pearson upper bound on a rate with ``events`` in ``trials`` (0 events: ``1 - (1 - c)^(1/n)``,
    about 3 / n, the rule of three).

    Args:
        events: events seen.
        trials: trials.
        confidence: one-sided confidence.
    """
    if trials <= 0:
        return 1.0
    if events >= trials:
        return 1.0
    alpha = 1.0 - confidence
    if events == 0:
        return 1.0 - alpha ** (1.0 / trials)
    lo, hi = events / trials, 1.0  # P(X <= events | p) falls with p: bisect for alpha
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _binom_cdf(events, trials, mid) > alpha else (lo, mid)
    return hi


def _binom_cdf(k: int, n: int, p: float) -> float:
    lp, lq = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq
             for i in range(k + 1)]
    top = max(terms)
    return math.exp(top) * sum(math.exp(t - top) for t in terms)


@dataclass(frozen=True)
class HonestRow:
    """One engine pair's honest streams.

    Args:
        pair: ``worker engine dtype / plane / trainer recompute``.
        records: honest records (groups) scored.
        sequences: completions in them.
        workers: streams the records were dealt into (one simulated worker each, no record reused).
        quarantined: streams whose CUSUM alarmed.
        score_mean: mean record score.
        score_p99: 99th percentile of the record scores.
        score_max: largest record score.
        peak: the largest CUSUM value any stream reached.
    """

    pair: str
    records: int
    sequences: int
    workers: int
    quarantined: int
    score_mean: float
    score_p99: float
    score_max: float
    peak: float

    @property
    def fp_upper(self) -> float:
        """95% upper bound on false quarantines per honest sequence."""
        return upper_bound(self.quarantined, self.sequences)


def honest_row(pair: str, scores: np.ndarray, samples: int, stream: int, params: CusumParams) -> HonestRow:
    """Deal ``scores`` in order into streams of ``stream`` records and run a fresh CUSUM on each.

    Args:
        pair: label.
        scores: per-record scores, in sampling order.
        samples: completions per record.
        stream: records per simulated worker.
        params: the test.
    """
    chunks = [scores[i:i + stream] for i in range(0, len(scores), stream)]
    alarms, peak = 0, 0.0
    for c in chunks:
        alarms += run_length(c, params) > 0
        peak = max(peak, _peak(c, params))
    return HonestRow(pair, len(scores), len(scores) * samples, len(chunks), alarms, float(scores.mean()),
                     float(np.quantile(scores, 0.99)), float(scores.max()), peak)


def _peak(scores: np.ndarray, params: CusumParams) -> float:
    s, top = 0.0, 0.0
    for x in np.clip(np.nan_to_num(scores, nan=params.cap), 0.0, params.cap):
        s = max(0.0, s + float(x) - params.drift)
        top = max(top, s)
    return top


@dataclass(frozen=True)
class AttackRow:
    """One attack's streams: shuffled orders of its record pool, each run until the CUSUM alarms.

    Args:
        attack: label.
        records: records in the pool (the horizon of each stream).
        streams: streams run.
        detected: streams that alarmed within the pool.
        median_records: median records-to-detect over the detected streams (0: none).
        max_records: largest records-to-detect (0: none).
        score_mean: mean record score.
    """

    attack: str
    records: int
    streams: int
    detected: int
    median_records: float
    max_records: int
    score_mean: float


def attack_row(attack: str, scores: np.ndarray, streams: int, params: CusumParams, seed: int) -> AttackRow:
    """Run ``streams`` CUSUMs over random orders of ``scores``.

    Args:
        attack: label.
        scores: the attack's per-record scores.
        streams: orders to try.
        params: the test.
        seed: shuffle seed.
    """
    rng = np.random.default_rng(seed)
    lengths = [run_length(rng.permutation(scores), params) for _ in range(streams)]
    hits = [n for n in lengths if n > 0]
    return AttackRow(attack, len(scores), streams, len(hits), float(np.median(hits)) if hits else 0.0,
                     max(hits, default=0), float(scores.mean()))


def table(honest: list[HonestRow], attacks: list[AttackRow]) -> list[str]:
    """Markdown tables of the rows; the attack table only when there are attack rows (``--attacks none``)."""
    lines = ["| engine pair (worker / plane / trainer) | honest sequences | workers | false quarantines | "
             "95% upper bound per sequence | record score mean / p99 / max | peak CUSUM |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    lines += [f"| {r.pair} | {r.sequences:,} | {r.workers} | {r.quarantined} | {r.fp_upper:.2g} | "
              f"{r.score_mean:.4f} / {r.score_p99:.4f} / {r.score_max:.4f} | {r.peak:.3f} |" for r in honest]
    if not attacks:
        return lines
    lines += ["", "| attack | record score mean | streams | detected | median records to detect | max |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {a.attack} | {a.score_mean:.4f} | {a.streams} | {a.detected}/{a.streams} (within "
              f"{a.records}) | {a.median_records:g} | {a.max_records} |" for a in attacks]
    return lines
