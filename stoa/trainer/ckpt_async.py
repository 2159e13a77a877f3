"""Checkpoints written in the background: the step's path takes a snapshot, a thread writes it.

A checkpoint's write (DCP serialization, the upload of every file, the pointer, dropping older checkpoints)
takes seconds to minutes on a real model and bucket; the step only needs its state fixed. So at world size 1
``RankOps.save`` copies the state to host memory (:func:`stoa.trainer.checkpoint.stage_checkpoint` with
``snapshot``: 12 bytes per trainable parameter, held while the write runs) and hands the write to a
:class:`CheckpointWriter`. The order of writes is that of a synchronous checkpoint:

- files first, then the pointer, then older checkpoints dropped: a kill mid-write leaves the previous
  checkpoint named and loadable (its files are deleted only after a newer pointer names another);
- the pointer of a checkpoint that claims version v is written only once v's weights pointer is in (the trainer
  passes a wait on v's upload as ``before_pointer``), so a checkpoint is never ahead of the pointer it claims;
- at most one write in flight: the next checkpoint waits for the last one before it takes its snapshot (one
  snapshot held at most);
- the trainer waits for the last write before it reports the run finished, fails it, or releases its lease.

A sharded trainer (world size > 1) writes synchronously: DCP's save runs collectives, which must stay on the
thread that runs the step's collectives.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from stoa.trainer.overlap import Background, Done


class CheckpointWriter:
    """Runs one checkpoint write at a time, on a thread (``background``) or at once.

    Args:
        background: write on a thread (``run`` returns at once); False writes inside ``run``.
    """

    def __init__(self, background: bool):
        self.background = background
        self._job: Background[int] | None = None
        self.last: Done[int] | None = None
        """The last write that finished: its bytes (rank 0) and seconds."""
        self.waited_s = 0.0
        """Seconds the last :meth:`wait` blocked (a checkpoint waiting for the one before it)."""

    def in_flight(self) -> bool:
        """Whether a write is still running."""
        return self._job is not None and not self._job.done()

    def wait(self) -> Done[int] | None:
        """Wait for the write in flight, if any; the last finished write.

        Raises:
            BaseException: what the write raised (its pointer was then not written).
        """
        job, self._job = self._job, None
        t0 = time.perf_counter()
        try:
            if job is not None:
                self.last = job.join()
        finally:
            self.waited_s = time.perf_counter() - t0
        return self.last

    def run(self, write: Callable[[], int], name: str) -> int:
        """Start ``write`` (after the one in flight, if any, has finished); its bytes when written at once, else 0.

        Args:
            write: the checkpoint's write (``write_staged`` over a snapshot when in the background).
            name: the thread's name.
        """
        self.wait()
        if not self.background:
            t0 = time.perf_counter()
            self.last = Done(write(), time.perf_counter() - t0)
            return self.last.value
        self._job = Background(write, name)
        return 0
