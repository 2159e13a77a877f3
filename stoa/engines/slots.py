"""Continuous batching of episodes, engine-neutral: the queue of episodes not admitted yet and its accounting.

With ``decode_slots`` below the rows, at most that many rows decode or wait for a tool at once; the other episodes
queue in row order (``RowQueue``) and take the slots of rows that end. A queued prompt is prefilled when its first
row is admitted, once, and its state kept until its last row is admitted. The engines own the prefill and the
merge of rows into a decoding batch (torch: ``torch_episodes``, MLX: ``mlx.slots``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from stoa.engines.base import GenStats

S = TypeVar("S")
"""One prompt's prefilled state (its cache and last logits), shared by its rows."""
B = TypeVar("B")
"""A decoding batch of admitted rows."""

Prefill = Callable[[list[Sequence[int]]], list[S]]
"""Prompts -> each one's prefilled state, in order."""
Merge = Callable[[dict[int, S]], B]
"""Row -> its prompt's state (row order) -> one decoding batch of those rows (the states are not changed)."""


def check_slots(slots: int) -> int:
    """``slots`` when it is a valid ``decode_slots`` (0: every row at once); ValueError otherwise."""
    if slots < 0:
        raise ValueError(f"decode_slots: {slots}; use 0 (every row at once) or the most rows decoding at once")
    return slots


def queues(slots: int, rows: int) -> bool:
    """True when ``slots`` leaves episodes of ``rows`` waiting (so the call runs a ``RowQueue``)."""
    return 0 < check_slots(slots) < rows


class RowQueue(Generic[S, B]):
    """The episodes not admitted yet (row ``g * n + j``, in row order) and the prefilled prompts of some of them.

    Args:
        prompts: token ids of each prompt.
        n: rows per prompt.
        prefill: the engine's prefill of prompts (each at most once).
        merge: the engine's merge of rows into a batch.
    """

    def __init__(self, prompts: Sequence[Sequence[int]], n: int, prefill: Prefill[S], merge: Merge[S, B]):
        self.prompts, self.n, self._prefill, self._merge = list(prompts), n, prefill, merge
        self.rows: deque[int] = deque(range(len(self.prompts) * n))
        self._ready: dict[int, S] = {}
        """Prompt -> its prefilled state, kept until its last row is admitted."""

    def __len__(self) -> int:
        return len(self.rows)

    def admit(self, k: int) -> B | None:
        """The next ``k`` queued rows (fewer when fewer wait) as one decoding batch, their prompts prefilled.

        Prompts not prefilled yet are prefilled in one ``prefill`` call; a prompt whose rows are admitted over
        several calls is prefilled once. None when no row is admitted.

        Args:
            k: free slots.
        """
        take = [self.rows.popleft() for _ in range(min(k, len(self.rows)))]
        if not take:
            return None
        need = sorted({r // self.n for r in take} - set(self._ready))
        if need:
            self._ready.update(zip(need, self._prefill([self.prompts[g] for g in need]), strict=True))
        rows = {r: self._ready[r // self.n] for r in take}
        for r in take:
            if r % self.n == self.n - 1:
                del self._ready[r // self.n]
        return self._merge(rows)


def admit_timed(queue: RowQueue[S, B], free: int, stats: GenStats) -> B | None:
    """Admit queued rows into ``free`` slots (None when none is free or none waits), timing the prefill.

    Args:
        queue: the episodes waiting.
        free: slots no row decodes or waits in.
        stats: ``prefill_s`` and ``extra["admit_prefill_s"]`` grow by the admission's time; after the first step
            (``steps``) ``extra["admitted"]`` by the rows admitted.
    """
    if free <= 0 or not queue:
        return None
    t1, waiting = time.perf_counter(), len(queue)
    new = queue.admit(free)
    took = time.perf_counter() - t1
    stats.prefill_s += took
    stats.extra["admit_prefill_s"] = stats.extra.get("admit_prefill_s", 0.0) + took
    if stats.steps:
        stats.extra["admitted"] = stats.extra.get("admitted", 0.0) + waiting - len(queue)
    return new
