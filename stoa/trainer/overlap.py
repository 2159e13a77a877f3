"""Work the trainer does while a step computes: the next step's intake and the upload of the last version.

The step itself (forward, backward, optimizer) releases the GIL in torch's kernels, so a thread can list, fetch and
validate records, and encode and upload a PULSE patch, in the meantime. The order of writes does not change:
the version's weights are converted from the live parameters before the next step touches them, its pointer is
still written after its patch or anchor, and the next journal is written only once that pointer is in.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, NamedTuple, TypeVar

_T = TypeVar("_T")


class Done(NamedTuple, Generic[_T]):
    """What a background job returned, and how long it ran."""

    value: _T
    seconds: float


class Background(Generic[_T]):
    """Run ``fn`` on a daemon thread now; ``join`` waits and returns its result (or raises its exception).

    Args:
        fn: the work.
        name: the thread's name.
    """

    def __init__(self, fn: Callable[[], _T], name: str):
        self._fn, self._out = fn, None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self._out = Done(self._fn(), time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - handed to the joining thread
            self._error = e

    def done(self) -> bool:
        """Whether the work has finished (``join`` then returns at once)."""
        return not self._thread.is_alive()

    def join(self) -> Done[_T]:
        """Wait for the work; its result and seconds.

        Raises:
            BaseException: whatever the work raised.
        """
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._out is not None
        return self._out
