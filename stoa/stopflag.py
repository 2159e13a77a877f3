"""One stop flag for SIGINT/SIGTERM, used by the trainer and local mode.

The first signal asks the loop to stop after its current step (the loop checks ``requested``, then saves
and returns); a second one interrupts at once (``KeyboardInterrupt``).
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals a ``StopFlag`` handles."""


class StopFlag:
    """Set by the first SIGINT/SIGTERM while installed; the second raises ``KeyboardInterrupt``.

    Attributes:
        requested: a signal asked the loop to stop after its current step.
    """

    def __init__(self) -> None:
        self.requested = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopFlag]:
        """Handle the signals inside the block (main thread only; elsewhere nothing is installed) and
        restore the previous handlers afterwards."""
        previous: dict[int, Any] = {}
        for sig in SIGNALS:
            try:
                previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("stop requested (%s): finishing the current step; a second signal interrupts",
                    signal.Signals(signum).name)
