"""A torch worker sizes its decode batch from the memory it decodes in: a CUDA GPU's free memory, Apple's GPU's
recommended working set (else unified RAM), the machine's RAM on a CPU; MLX keeps the machine's RAM."""

from __future__ import annotations

import pytest
import torch

from stoa.cli import main
from stoa.worker import tiers
from stoa.worker.tiers import DEVICE_FREE, DEVICE_RECOMMENDED, HOST_RAM, choose_tier, describe_tier, device_memory

GB = 1e9


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (tiers.ENV_DECODE_BATCH, tiers.ENV_GROUPS_IN_FLIGHT, tiers.ENV_MEMORY_GB):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tiers, "system_memory", lambda: (25.3, "/proc/meminfo"))  # this 24 GB host


def fake_gpu(monkeypatch: pytest.MonkeyPatch, free_gb: float, total_gb: float) -> list[int]:
    """torch sees one CUDA GPU with ``free_gb`` of ``total_gb`` free; returns the indices asked about."""
    asked: list[int] = []

    def mem_get_info(index: int) -> tuple[int, int]:
        asked.append(index)
        return int(free_gb * GB), int(total_gb * GB)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    return asked


@pytest.mark.parametrize("free_gb,total_gb,batch,groups", [
    (70.0, 85.0, 64, 8),   # an 80 GB H100 with 70 GB free: the 64 GB tier, not the host's 24 GB
    (23.5, 25.3, 24, 3),   # a 24 GB card, its context and a little else already on it
    (5.0, 25.3, 8, 1),     # the card mostly taken by another process: below the 8 GB tier, one whole group
])
def test_a_cuda_worker_sizes_from_the_gpus_free_memory(monkeypatch, free_gb, total_gb, batch, groups):
    asked = fake_gpu(monkeypatch, free_gb, total_gb)
    c = choose_tier(n_samples=8, engine="torch", device="auto")
    assert (c.decode_batch, c.groups_in_flight, c.memory_kind, c.device) == (batch, groups, DEVICE_FREE, "cuda:0")
    assert c.memory_gb == pytest.approx(free_gb) and asked == [0]
    assert "torch.cuda.mem_get_info(cuda:0)" in c.memory_source


def test_the_cuda_index_named_is_the_one_asked(monkeypatch):
    asked = fake_gpu(monkeypatch, 40.0, 85.0)
    assert device_memory("torch", "cuda:1").device == "cuda:1" and asked == [1]


def test_a_cpu_worker_and_mlx_keep_the_machines_ram(monkeypatch):
    fake_gpu(monkeypatch, 70.0, 85.0)
    for engine, device in (("torch", "cpu"), ("mlx", "auto"), ("mlx", "cuda")):
        c = choose_tier(n_samples=8, engine=engine, device=device)
        assert (c.memory_gb, c.memory_source, c.memory_kind, c.decode_batch) == (25.3, "/proc/meminfo", HOST_RAM, 24)


def test_stoa_memory_gb_still_wins_on_a_gpu(monkeypatch):
    fake_gpu(monkeypatch, 70.0, 85.0)
    monkeypatch.setattr(tiers, "system_memory", lambda: (16.0, tiers.ENV_MEMORY_GB))
    monkeypatch.setenv(tiers.ENV_MEMORY_GB, "16")
    c = choose_tier(n_samples=8, engine="torch", device="cuda")
    assert (c.decode_batch, c.memory_source, c.memory_kind) == (16, tiers.ENV_MEMORY_GB, "set by STOA_MEMORY_GB")


def test_a_cuda_device_torch_cannot_see_is_one_line_naming_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="torch sees no CUDA GPU; use --device auto or cpu"):
        device_memory("torch", "cuda")
    assert device_memory("torch", "auto").device == "cpu"  # auto falls back to the CPU and its RAM


def fake_mac(monkeypatch: pytest.MonkeyPatch, recommended_gb: float | None) -> None:
    """A 16 GB Mac (17.18 GB of unified RAM) whose torch has MPS, with or without ``recommended_max_memory``."""
    monkeypatch.setattr(tiers.sys, "platform", "darwin")
    monkeypatch.setattr(tiers, "system_memory", lambda: (17.18, "sysctl hw.memsize"))
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    if recommended_gb is None:
        monkeypatch.delattr(torch.mps, "recommended_max_memory", raising=False)
    else:
        monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: int(recommended_gb * GB), raising=False)


def test_a_16_gb_mac_under_torch_sizes_from_metals_recommended_working_set(monkeypatch):
    fake_mac(monkeypatch, 11.45)  # macOS lets the GPU hold about 2/3 of a 16 GB Mac's memory
    c = choose_tier(n_samples=8, engine="torch", device="mps")
    assert (c.decode_batch, c.memory_kind, c.device, c.memory_source) == (
        8, DEVICE_RECOMMENDED, "mps", "torch.mps.recommended_max_memory()")


def test_an_older_torch_on_a_mac_sizes_from_unified_ram(monkeypatch):
    fake_mac(monkeypatch, None)
    c = choose_tier(n_samples=8, engine="torch", device="mps")
    assert (c.decode_batch, c.memory_kind, c.memory_source) == (16, tiers.UNIFIED_RAM, "sysctl hw.memsize")


def test_print_tier_shows_the_device_and_the_memory_it_sized_from(monkeypatch, capsys):
    fake_gpu(monkeypatch, 70.0, 85.0)
    assert main(["worker", "--print-tier", "--engine", "torch", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "device:            cuda:0" in out
    assert "memory:            70.0 GB device free memory (from torch.cuda.mem_get_info(cuda:0), of 85.0 GB)" in out
    assert "decode batch G:    64 rows (8 groups x n=8)" in out
    assert "memory:            25.3 GB host RAM (from /proc/meminfo)" in describe_tier(8, engine="torch", device="cpu")


def test_only_a_worker_takes_mps(capsys):
    assert main(["worker", "--print-tier", "--engine", "torch", "--device", "nope"]) == 2
    assert "use auto, cpu, cuda, cuda:N or mps" in capsys.readouterr().err
    assert main(["trainer", "--dry-run", "--device", "mps"]) == 2
    assert "use auto, cpu, cuda, cuda:N" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_real_gpu_reports_its_free_memory():
    m = device_memory("torch", "cuda")
    free, total = torch.cuda.mem_get_info(0)
    assert m.kind == DEVICE_FREE and 0 < m.gb <= total / GB and abs(m.gb - free / GB) < 2.0
    c = choose_tier(n_samples=8, engine="torch", device="cuda")
    assert c.device == "cuda:0" and c.decode_batch >= 8
