"""Memory tiers pick the decode batch and groups in flight; arguments and env override; BLAS is reported."""

from __future__ import annotations

import platform

import pytest

from stoa.worker import tiers
from stoa.worker.tiers import choose_tier, describe_tier, system_memory, tier_decode_batch

ENV = (tiers.ENV_DECODE_BATCH, tiers.ENV_GROUPS_IN_FLIGHT, tiers.ENV_MEMORY_GB)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    "memory_gb,tier,g",
    [(4, 0, 4), (8.59, 8, 8), (17.18, 16, 16), (23.6, 24, 24), (34.4, 32, 32), (51.5, 48, 48),
     (68.7, 64, 64), (103, 96, 96), (137, 128, 128), (512, 128, 128), (7.0, 0, 4), (7.3, 8, 8)],
)
def test_tier_table(memory_gb: float, tier: float, g: int) -> None:
    assert tier_decode_batch(memory_gb) == (tier, g)


def test_groups_follow_the_group_size() -> None:
    c = choose_tier(24, n_samples=8)
    assert (c.decode_batch, c.groups_in_flight, c.tier_gb) == (24, 3, 24)
    c = choose_tier(24, n_samples=4)
    assert (c.decode_batch, c.groups_in_flight) == (24, 6)
    c = choose_tier(8, n_samples=16)  # at least one whole group
    assert (c.decode_batch, c.groups_in_flight) == (16, 1)


def test_arguments_override_the_table() -> None:
    c = choose_tier(16, n_samples=8, decode_batch=40)
    assert (c.decode_batch, c.groups_in_flight) == (40, 5) and "decode_batch=40" in c.overrides
    c = choose_tier(16, n_samples=8, groups_in_flight=3, decode_batch=64)
    assert (c.decode_batch, c.groups_in_flight) == (24, 3)


def test_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tiers.ENV_MEMORY_GB, "64")
    c = choose_tier(n_samples=8)
    assert (c.memory_gb, c.memory_source, c.decode_batch) == (64.0, tiers.ENV_MEMORY_GB, 64)
    monkeypatch.setenv(tiers.ENV_DECODE_BATCH, "16")
    assert choose_tier(n_samples=8).groups_in_flight == 2
    monkeypatch.setenv(tiers.ENV_GROUPS_IN_FLIGHT, "5")
    c = choose_tier(n_samples=8)
    assert (c.groups_in_flight, c.decode_batch) == (5, 40)
    assert f"{tiers.ENV_GROUPS_IN_FLIGHT}=5" in c.overrides
    assert choose_tier(n_samples=8, groups_in_flight=2).groups_in_flight == 2  # argument beats env


@pytest.mark.parametrize("name", ENV)
@pytest.mark.parametrize("value", ["abc", "0", "-3", "1.5x"])
def test_bad_env_values_name_the_variable(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        choose_tier(n_samples=8)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="n_samples"):
        choose_tier(16, n_samples=0)
    with pytest.raises(ValueError, match="decode_batch"):
        choose_tier(16, decode_batch=0)
    with pytest.raises(ValueError, match="memory_gb"):
        choose_tier(-1.0)


def test_kv_budget_caps_the_table() -> None:
    # 16 GB, 25% for KV = 4 GB; 0.5 GB per row -> at most 8 rows.
    c = choose_tier(16, n_samples=4, kv_bytes_per_row=500_000_000)
    assert (c.decode_batch, c.groups_in_flight) == (8, 2)
    # An explicit override is not lowered.
    assert choose_tier(16, n_samples=4, decode_batch=16, kv_bytes_per_row=500_000_000).decode_batch == 16


def test_system_memory_is_read() -> None:
    gb, source = system_memory()
    assert gb > 0.1 and source


def test_describe_tier_text(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tiers.ENV_MEMORY_GB, "32")
    text = describe_tier(n_samples=8)
    assert "32.0 GB" in text and "decode batch G:    32 rows (4 groups x n=8)" in text
    assert "groups in flight:  4" in text and "MLX BLAS:" in text and tiers.ENV_MEMORY_GB in text


def test_blas_status_names_the_library() -> None:
    status = tiers.blas_status()
    if platform.system() == "Linux":
        assert status.startswith(("mkl", "reference", "openblas"))
    else:
        assert status.startswith("platform")
