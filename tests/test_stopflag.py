"""The stop flag shared by the trainer and local mode: the first signal asks, the second interrupts, the
previous handlers come back."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from stoa.stopflag import StopFlag


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_first_signal_sets_the_flag_second_interrupts(sig):
    before = signal.getsignal(sig)
    stop = StopFlag()
    with stop.installed():
        assert not stop.requested
        os.kill(os.getpid(), sig)
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), sig)
    assert signal.getsignal(sig) is before


def test_off_the_main_thread_nothing_is_installed():
    before = signal.getsignal(signal.SIGTERM)
    seen: list[bool] = []

    def body() -> None:
        with StopFlag().installed() as stop:
            seen.append(signal.getsignal(signal.SIGTERM) is before and not stop.requested)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [True]
