"""What this machine can do for an MLX worker: memory tiers (decode batch, groups in flight) and the Linux BLAS."""

from __future__ import annotations

import os
from dataclasses import dataclass

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


@dataclass(frozen=True)
class TierChoice:
    """The decode batch and groups in flight chosen for this machine, and why."""

    memory_gb: float
    """Memory the choice is based on."""
    memory_source: str
    """Where ``memory_gb`` came from (``STOA_MEMORY_GB``, ``sysctl hw.memsize``, ``/proc/meminfo``, ...)."""
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
) -> TierChoice:
    """Pick the decode batch G and groups in flight for this machine.

    Precedence for each value: argument, then environment (``STOA_DECODE_BATCH``, ``STOA_GROUPS_IN_FLIGHT``,
    ``STOA_MEMORY_GB``), then the tier table. Groups in flight default to ``max(1, G // n_samples)``; an
    explicit groups-in-flight sets G to ``groups x n_samples``.

    Args:
        memory_gb: memory to plan for (default: :func:`system_memory`).
        n_samples: group size n from the run contract.
        decode_batch: force G (rows decoded together).
        groups_in_flight: force the number of groups sampled together.
        kv_bytes_per_row: KV-cache bytes one row needs at full length (prompt + max new tokens); when given,
            G is lowered so the batch's KV cache stays within :data:`KV_MEMORY_FRACTION` of memory (an
            explicit override is not lowered).

    Raises:
        ValueError: on a non-positive argument or a malformed environment value (naming it).
    """
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    overrides: list[str] = []
    if memory_gb is None:
        memory_gb, source = system_memory()
        if source == ENV_MEMORY_GB:
            overrides.append(f"{ENV_MEMORY_GB}={memory_gb:g}")
    else:
        source = "argument"
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
                      overrides=tuple(overrides))


def describe_tier(n_samples: int = 8, choice: TierChoice | None = None) -> str:
    """The text ``stoa worker --print-tier`` prints: memory, tier, decode batch, groups in flight, BLAS.

    Args:
        n_samples: group size n the choice assumes (the run's ``n_samples``).
        choice: a choice already made (default: :func:`choose_tier` with ``n_samples``).
    """
    c = choice or choose_tier(n_samples=n_samples)
    lines = [
        f"memory:            {c.memory_gb:.1f} GB (from {c.memory_source})",
        f"tier:              {c.tier_gb:g} GB" if c.tier_gb else "tier:              below 8 GB",
        f"decode batch G:    {c.decode_batch} rows ({c.groups_in_flight} groups x n={c.n_samples})",
        f"groups in flight:  {c.groups_in_flight}",
        f"overrides:         {', '.join(c.overrides) if c.overrides else 'none'}"
        f" (env {ENV_MEMORY_GB}, {ENV_DECODE_BATCH}, {ENV_GROUPS_IN_FLIGHT})",
        f"MLX BLAS:          {blas_status()}",
    ]
    return "\n".join(lines)

