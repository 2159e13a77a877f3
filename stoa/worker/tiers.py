"""What this machine can do for a worker: memory tiers (decode batch, groups in flight) and the Linux BLAS.

The memory a tier is chosen from is the memory the engine decodes in (:func:`device_memory`): a torch worker on
CUDA sizes from the GPU's free memory, one on Apple's GPU (``mps``) from Metal's recommended working set, and the
MLX engine and torch on a CPU from the machine's RAM (``stoa.machine.system_memory``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from stoa.engines.factory import default_engine
from stoa.engines.mlx_blas import blas_status
from stoa.machine import ENV_MEMORY_GB, system_memory

ENV_DECODE_BATCH = "STOA_DECODE_BATCH"
ENV_GROUPS_IN_FLIGHT = "STOA_GROUPS_IN_FLIGHT"

TIERS: tuple[tuple[float, int], ...] = (
    (8, 8),
    (16, 16),
    (24, 24),
    (32, 32),
    (48, 48),
    (64, 64),
    (96, 96),
    (128, 128),
)
"""(memory GB at least, decode batch G): the largest tier not above the machine's memory wins.

Apple silicon's memory size tracks its GPU: base chips (8-10 GPU cores) ship with 8-24 GB, Pro (14-20)
with 18-48 GB, Max (30-40) with 36-128 GB, Ultra (60-80) with 64-192 GB. Batched decode of a small policy
is bound by GPU throughput, which keeps growing with the batch until the cores are busy, so G grows with
the tier. Machines below 8 GB get G = 4. KV memory is capped separately (``kv_bytes_per_row``).
"""

KV_MEMORY_FRACTION = 0.25
"""At most this fraction of memory goes to the decode batch's KV cache."""


DEVICE_FREE = "device free memory"
"""``DeviceMemory.kind`` of a CUDA GPU: free memory now (after the engine's weights, when sized by the worker)."""
DEVICE_RECOMMENDED = "device recommended max"
"""``DeviceMemory.kind`` of Apple's GPU under torch (``torch.mps.recommended_max_memory``)."""
UNIFIED_RAM = "unified RAM"
"""``DeviceMemory.kind`` on a Mac: the machine's memory, which CPU and GPU share."""
HOST_RAM = "host RAM"
"""``DeviceMemory.kind`` of a CPU engine on Linux (and the MLX engine there)."""


@dataclass(frozen=True)
class DeviceMemory:
    """The memory a worker's decode batch is sized from, and where it was read."""

    gb: float
    """Memory in GB (1e9 bytes)."""
    source: str
    """The call or file it came from (``torch.cuda.mem_get_info(cuda:0)``, ``/proc/meminfo``, ...)."""
    kind: str
    """What it is: :data:`DEVICE_FREE`, :data:`DEVICE_RECOMMENDED`, :data:`UNIFIED_RAM` or :data:`HOST_RAM`."""
    device: str
    """Where the engine decodes: ``mlx``, ``cpu``, ``mps``, ``cuda:N``."""


def _ram(device: str) -> DeviceMemory:
    gb, source = system_memory()
    kind = UNIFIED_RAM if sys.platform == "darwin" else HOST_RAM
    return DeviceMemory(gb, source, f"set by {ENV_MEMORY_GB}" if source == ENV_MEMORY_GB else kind, device)


def _cuda_memory(torch, device: str) -> DeviceMemory:
    if not torch.cuda.is_available():
        raise RuntimeError(f"device {device}: torch sees no CUDA GPU; use --device auto or cpu, or set {ENV_MEMORY_GB}")
    index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    return DeviceMemory(free / 1e9, f"torch.cuda.mem_get_info(cuda:{index}), of {total / 1e9:.1f} GB", DEVICE_FREE,
                        f"cuda:{index}")


def _mps_memory(torch) -> DeviceMemory:
    backend = getattr(torch.backends, "mps", None)
    if backend is None or not backend.is_available():
        raise RuntimeError(f"device mps: torch sees no Apple GPU; use --device cpu, or set {ENV_MEMORY_GB}")
    mps = getattr(torch, "mps", None)
    query = getattr(mps, "recommended_max_memory", None)  # torch >= 2.5; older ones size from unified RAM
    if query is not None:
        size = int(query())
        if size > 0:
            return DeviceMemory(size / 1e9, "torch.mps.recommended_max_memory()", DEVICE_RECOMMENDED, "mps")
    return _ram("mps")


def device_memory(engine: str = "auto", device: str = "auto") -> DeviceMemory:
    """The memory the worker's engine decodes in, which its tier is chosen from.

    ``STOA_MEMORY_GB`` wins everywhere. The MLX engine and torch on a CPU read the machine's RAM (unchanged);
    torch on CUDA reads the GPU's free memory (``torch.cuda.mem_get_info``), so weights already loaded and
    other processes on the card count against it; torch on ``mps`` reads Metal's recommended working set
    (``torch.mps.recommended_max_memory``, else unified RAM).

    Args:
        engine: ``auto`` (:func:`~stoa.engines.factory.default_engine`), ``torch`` or ``mlx``.
        device: the torch device (``auto``: cuda when torch sees one, else cpu; ``cpu``, ``cuda[:N]``, ``mps``).

    Raises:
        ValueError: a malformed ``STOA_MEMORY_GB``.
        RuntimeError: a CUDA device torch cannot see, or no RAM figure could be read.
    """
    name = default_engine() if engine == "auto" else engine
    if name != "torch":
        return _ram("mlx")
    import torch  # the torch engine loads it anyway

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if _env_number(ENV_MEMORY_GB, float) is not None:
        return _ram(device)
    if device.startswith("cuda"):
        return _cuda_memory(torch, device)
    if device == "mps":
        return _mps_memory(torch)
    return _ram(device)


@dataclass(frozen=True)
class TierChoice:
    """The decode batch and groups in flight chosen for this machine, and why."""

    memory_gb: float
    """Memory the choice is based on."""
    memory_source: str
    """Where ``memory_gb`` came from (``STOA_MEMORY_GB``, ``sysctl hw.memsize``, ``/proc/meminfo``,
    ``torch.cuda.mem_get_info(cuda:0)``, ...)."""
    tier_gb: float
    """The tier that matched (0 below the smallest tier)."""
    decode_batch: int
    """Rows decoded together (G = groups in flight x n, rounded down to whole groups)."""
    groups_in_flight: int
    """Prompt groups sampled together."""
    n_samples: int
    """Group size the choice assumed."""
    overrides: tuple[str, ...] = ()
    """Which values came from arguments or the environment instead of the table."""
    memory_kind: str = HOST_RAM
    """What ``memory_gb`` is (``DeviceMemory.kind``: device free memory, host RAM, ...)."""
    device: str = ""
    """Where the engine decodes (``DeviceMemory.device``); empty when ``memory_gb`` was an argument."""


def _env_number(name: str, kind: type) -> float | int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be > 0")
    return value


def tier_decode_batch(memory_gb: float) -> tuple[float, int]:
    """The matching tier and its decode batch G for ``memory_gb`` (see :data:`TIERS`).

    Args:
        memory_gb: total memory in GB. Marketed sizes count GiB (a "16 GB" Mac reports 17.2e9 bytes), and
            a machine is put in a tier when it has at least 90% of the tier's size, so a 24 GB Linux box
            that reports 23.6 GB lands in the 24 GB tier.
    """
    tier, g = 0.0, 4
    for gb, batch in TIERS:
        if memory_gb >= 0.9 * gb:
            tier, g = gb, batch
    return tier, g


def _forced(arg: int | None, env: str, label: str, overrides: list[str]) -> int | None:
    if arg is not None:
        if arg < 1:
            raise ValueError(f"{label} must be >= 1, got {arg}")
        overrides.append(f"{label}={arg}")
        return int(arg)
    value = _env_number(env, int)
    if value is not None:
        overrides.append(f"{env}={value}")
    return None if value is None else int(value)


def choose_tier(
    memory_gb: float | None = None,
    *,
    n_samples: int = 8,
    decode_batch: int | None = None,
    groups_in_flight: int | None = None,
    kv_bytes_per_row: int | None = None,
    engine: str = "auto",
    device: str = "auto",
) -> TierChoice:
    """Pick the decode batch G and groups in flight for this machine.

    Precedence for each value: argument, then environment (``STOA_DECODE_BATCH``, ``STOA_GROUPS_IN_FLIGHT``,
    ``STOA_MEMORY_GB``), then the tier table. Groups in flight default to ``max(1, G // n_samples)``; an
    explicit groups-in-flight sets G to ``groups x n_samples``.

    Args:
        memory_gb: memory to plan for (default: :func:`device_memory` of ``engine`` and ``device``).
        n_samples: group size n from the run contract.
        decode_batch: force G (rows decoded together).
        groups_in_flight: force the number of groups sampled together.
        kv_bytes_per_row: KV-cache bytes one row needs at full length (prompt + max new tokens); when given,
            G is lowered so the batch's KV cache stays within :data:`KV_MEMORY_FRACTION` of memory (an
            explicit override is not lowered).
        engine: the worker's engine (``auto``, ``torch``, ``mlx``), for :func:`device_memory`.
        device: the torch engine's device, for :func:`device_memory`.

    Raises:
        ValueError: on a non-positive argument or a malformed environment value (naming it).
    """
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    overrides: list[str] = []
    if memory_gb is None:
        mem = device_memory(engine, device)
        memory_gb, source, kind, where = mem.gb, mem.source, mem.kind, mem.device
        if source == ENV_MEMORY_GB:
            overrides.append(f"{ENV_MEMORY_GB}={memory_gb:g}")
    else:
        source, kind, where = "argument", HOST_RAM, ""
        overrides.append(f"memory_gb={memory_gb:g}")
    if memory_gb <= 0:
        raise ValueError(f"memory_gb must be > 0, got {memory_gb}")
    tier, g = tier_decode_batch(memory_gb)
    if kv_bytes_per_row:
        cap = int(KV_MEMORY_FRACTION * memory_gb * 1e9 // kv_bytes_per_row)
        g = max(1, min(g, cap))
    groups = _forced(groups_in_flight, ENV_GROUPS_IN_FLIGHT, "groups_in_flight", overrides)
    batch = _forced(decode_batch, ENV_DECODE_BATCH, "decode_batch", overrides)
    if groups is None:
        groups = max(1, (batch if batch is not None else g) // n_samples)
    return TierChoice(memory_gb=float(memory_gb), memory_source=source, tier_gb=tier,
                      decode_batch=groups * n_samples, groups_in_flight=groups, n_samples=n_samples,
                      overrides=tuple(overrides), memory_kind=kind, device=where)


def describe_tier(n_samples: int = 8, choice: TierChoice | None = None, *, engine: str = "auto",
                  device: str = "auto") -> str:
    """The text ``stoa worker --print-tier`` prints: device, memory (and what it is), tier, decode batch, groups
    in flight, BLAS.

    Args:
        n_samples: group size n the choice assumes (the run's ``n_samples``).
        choice: a choice already made (default: :func:`choose_tier` with ``n_samples``, ``engine``, ``device``).
        engine: the worker's engine (``auto``, ``torch``, ``mlx``).
        device: the torch engine's device.
    """
    c = choice or choose_tier(n_samples=n_samples, engine=engine, device=device)
    lines = [
        f"device:            {c.device or 'not asked'}",
        f"memory:            {c.memory_gb:.1f} GB {c.memory_kind} (from {c.memory_source})",
        f"tier:              {c.tier_gb:g} GB" if c.tier_gb else "tier:              below 8 GB",
        f"decode batch G:    {c.decode_batch} rows ({c.groups_in_flight} groups x n={c.n_samples})",
        f"groups in flight:  {c.groups_in_flight}",
        f"overrides:         {', '.join(c.overrides) if c.overrides else 'none'}"
        f" (env {ENV_MEMORY_GB}, {ENV_DECODE_BATCH}, {ENV_GROUPS_IN_FLIGHT})",
        f"MLX BLAS:          {blas_status()}",
    ]
    return "\n".join(lines)

