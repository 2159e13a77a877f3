"""Multi-turn decoding on the torch engine: decode the batch, pause rows at tool calls, feed observations, refill.

Rows decode until they end or pause (``EpisodeDriver.record``). A paused row leaves the batch with its cache
(``torch_rows.take_rows``). By default (``refill``, ``refill_share`` 0) the rows that paused at a step have their
tools run in one request (``driver.resume``) before the next step, are fed ``[last token] + observation`` in one
forward (``torch_rows.resume_rows``) and join the rows still decoding (``torch_rows.join_batches``): no row waits
for another, so a batch takes as many steps as its longest episode has action tokens (waiting until as many
rows paused as decode, ``refill_share`` 1, took up to 2x the steps of SmolLM2's search episodes, the
resumed rows decoding their next turn alone). Every row's positions stay contiguous, so a full forward
recomputes its logprobs.

Continuous batching (``slots`` below the rows): at most ``slots`` rows decode or wait for a tool at once; the
other episodes queue in row order (``RowQueue``, on ``stoa.engines.slots``). Before every step the free slots (rows
that ended) are given to queued rows: their prompts are prefilled in one forward (each prompt once, its state kept
until its last row is admitted) and the rows join the batch as resumed rows do. A batch then decodes ``slots`` rows
a step until the queue runs dry, instead of thinning out as its episodes end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from stoa.engines.base import GenStats
from stoa.engines.slots import RowQueue as SlotQueue
from stoa.engines.slots import admit_timed
from stoa.engines.torch_rows import DecodeBatch, RowKV, join_batches, merge_rows, resume_rows, take_rows
from stoa.episodes.driver import EpisodeDriver

Draw = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""[rows, V] logits -> [rows] sampled tokens and their logprobs (``torch.sample_step`` with the call's settings)."""


class RowQueue(SlotQueue[RowKV, DecodeBatch]):
    """The episodes not admitted yet on the torch engine (``stoa.engines.slots.RowQueue``): prompts prefilled in one
    forward (left-padded, as ``TorchEngine._prefill``), rows merged by ``merge_rows`` (copies: rows never share a
    tensor).

    Args:
        engine: the ``TorchEngine`` (``_prefill``, ``model``).
        prompts: token ids of each prompt.
        n: rows per prompt.
    """

    def __init__(self, engine: Any, prompts: Sequence[Sequence[int]], n: int):
        config = getattr(engine.model, "config", None)
        super().__init__(prompts, n, partial(_prefill, engine), partial(merge_rows, config=config))


def _prefill(engine: Any, prompts: list[Sequence[int]]) -> list[RowKV]:
    """Each prompt's state after one left-padded forward of them all (``logits`` set; no token pending)."""
    batch = engine._prefill(prompts, 1)
    states = take_rows(batch, range(len(prompts)), [-1] * len(prompts))
    for b in range(len(prompts)):
        states[b].logits = batch.logits[b]
    return [states[b] for b in range(len(prompts))]


def run_episodes(engine: Any, batch: DecodeBatch | RowQueue, driver: EpisodeDriver, draw: Draw, stats: GenStats,
                 refill: bool, share: float = 1.0, slots: int = 0) -> None:
    """Decode, resume and admit rows until every episode has ended.

    Args:
        engine: the ``TorchEngine`` (``_forward``, ``model``, ``_cache_kw``, ``batch_resumes``).
        batch: every row after the prompts' prefill; or the queue of rows, admitted ``slots`` at a time.
        driver: the episodes (records tokens, pauses and ends rows, runs the tools).
        draw: samples one token per row.
        stats: ``decode_s``, ``steps``, ``new_tokens`` and ``extra`` (``rounds``: tool requests,
            ``obs_prefill_s``, ``refills``: requests made while other rows still decoded; with a queue
            ``admitted``: rows admitted after the first step, and ``admit_prefill_s``) grow.
        refill: resume paused rows while other rows decode (once ``share`` allows); False waits until none decodes.
        share: with ``refill``, resume once the paused rows number at least ``share`` x the decoding rows (and at
            least one): 0 resumes a row at the step it pauses, 1 once as many wait as decode.
        slots: with a queue, the most rows decoding or paused at once (at least 1).

    Raises:
        ToolUnavailable: the tools could not answer (from ``driver.resume``).
    """
    queue = batch if isinstance(batch, RowQueue) else None
    live = _admit(engine, batch, None, 0, slots, stats) if isinstance(batch, RowQueue) else batch
    paused: dict[int, RowKV] = {}
    t0 = time.perf_counter()
    while live is not None:
        tok, tok_lp = draw(live.logits)
        stats.steps += 1
        stats.new_tokens += len(live.active)
        toks = tok.tolist()
        keep = driver.record(live.active, toks, tok_lp.tolist())
        waiting = set(driver.paused)
        stop = [i for i in range(len(live.active)) if live.active[i] in waiting]
        paused.update(take_rows(live, stop, [toks[i] for i in stop]))
        if keep:
            if len(keep) < len(live.active):
                tok = tok[live.compact(keep)]
            engine._forward(live, tok)
        else:
            live = None
        if paused and (live is None or (refill and len(paused) >= share * len(live.active))):
            stats.decode_s += time.perf_counter() - t0
            live = _resume(engine, driver, paused, live, stats)
            paused = {}
            t0 = time.perf_counter()
        if queue is not None and queue:
            stats.decode_s += time.perf_counter() - t0
            live = _admit(engine, queue, live, len(paused), slots, stats)
            t0 = time.perf_counter()
    stats.decode_s += time.perf_counter() - t0


def _admit(engine: Any, queue: RowQueue, live: DecodeBatch | None, waiting: int, slots: int,
           stats: GenStats) -> DecodeBatch | None:
    """Give the slots no row decodes or waits in to queued rows; the live rows, then the admitted ones."""
    new = admit_timed(queue, slots - waiting - (len(live.active) if live is not None else 0), stats)
    if new is None or live is None:
        return live if new is None else new
    return join_batches(live, new, getattr(engine.model, "config", None))


def _resume(engine: Any, driver: EpisodeDriver, paused: dict[int, RowKV], live: DecodeBatch | None,
            stats: GenStats) -> DecodeBatch | None:
    """Run the paused rows' tools, feed the rows that go on in one forward and join them to the live rows."""
    stats.extra["rounds"] += 1
    stats.extra["refills"] += live is not None
    fed = driver.resume()  # every paused row's tools in one request; the others have ended
    t1 = time.perf_counter()
    resumed = resume_rows(engine.model, engine._cache_kw, paused, fed, engine.batch_resumes)
    stats.extra["obs_prefill_s"] += time.perf_counter() - t1
    if live is None or resumed is None:
        return live if resumed is None else resumed
    return join_batches(live, resumed, getattr(engine.model, "config", None))
