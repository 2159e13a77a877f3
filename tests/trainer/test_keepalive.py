"""Rank 0's keep-alive while it waits for records, and the collective timeout it stays inside."""

from __future__ import annotations

import types

import pytest

from stoa.trainer import ranks
from stoa.trainer.dist import DEFAULT_TIMEOUT_S, timeout_s
from stoa.trainer.ranks import Command, Driver


class FakeDist:
    def __init__(self, sharded: bool):
        self.sharded, self.sent = sharded, []

    def broadcast(self, obj=None):
        self.sent.append(obj)
        return obj


def driver(sharded: bool) -> tuple[Driver, FakeDist]:
    dist = FakeDist(sharded)
    ops = types.SimpleNamespace(dist=dist, keepalive=lambda: None)
    return Driver(ops), dist  # type: ignore[arg-type]


def test_keepalive_is_sent_once_a_quarter_of_the_timeout_has_passed(monkeypatch):
    monkeypatch.setenv("STOA_DIST_TIMEOUT_S", "40")
    now = [100.0]
    monkeypatch.setattr(ranks.time, "monotonic", lambda: now[0])
    d, dist = driver(sharded=True)
    now[0] += 9.9
    assert not d.keepalive() and dist.sent == []
    now[0] += 0.2  # 10.1 s since the last command: a quarter of 40
    assert d.keepalive() and dist.sent == [Command("keepalive", ())]
    now[0] += 5
    assert not d.keepalive()  # the keep-alive itself counts as the last command
    d("keepalive")
    now[0] += 9
    assert not d.keepalive() and len(dist.sent) == 2


def test_a_single_process_sends_nothing(monkeypatch):
    monkeypatch.setattr(ranks.time, "monotonic", lambda: 1e9)
    d, dist = driver(sharded=False)
    assert not d.keepalive() and dist.sent == []


def test_the_timeout_comes_from_the_environment_or_the_default(monkeypatch):
    monkeypatch.delenv("STOA_DIST_TIMEOUT_S", raising=False)
    assert timeout_s() == DEFAULT_TIMEOUT_S
    monkeypatch.setenv("STOA_DIST_TIMEOUT_S", "90")
    assert timeout_s() == 90.0
    for bad in ("soon", "0", "-5", "nan", "inf"):
        monkeypatch.setenv("STOA_DIST_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="STOA_DIST_TIMEOUT_S"):
            timeout_s()
