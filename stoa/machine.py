"""Facts about this machine that several commands plan with (memory size); stdlib only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ENV_MEMORY_GB = "STOA_MEMORY_GB"
"""Set to a number of GB to override the memory this machine reports."""


def _env_memory_gb() -> float | None:
    raw = os.environ.get(ENV_MEMORY_GB, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_MEMORY_GB}={raw!r} is not a valid float") from None
    if value <= 0:
        raise ValueError(f"{ENV_MEMORY_GB}={raw!r} must be > 0")
    return value


def _cgroup_limit_bytes() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(path).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 1 << 60:
            return int(raw)
    return None


def system_memory() -> tuple[float, str]:
    """Total memory usable by this process in GB (1e9 bytes) and where the figure came from.

    Order: ``STOA_MEMORY_GB``; MLX's Metal device info when MLX is already loaded on a Mac; ``sysctl
    hw.memsize`` on macOS; ``/proc/meminfo`` on Linux, lowered to a cgroup memory limit when one is set.

    Raises:
        ValueError: when ``STOA_MEMORY_GB`` is not a positive number.
        RuntimeError: when no source could be read.
    """
    env = _env_memory_gb()
    if env is not None:
        return float(env), ENV_MEMORY_GB
    if sys.platform == "darwin":
        mx = sys.modules.get("mlx.core")
        if mx is not None:
            try:
                size = mx.device_info().get("memory_size")
                if size:
                    return int(size) / 1e9, "mx.device_info()"
            except (AttributeError, RuntimeError):
                pass
        try:
            out = subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True, timeout=5)
            return int(out.stdout.strip()) / 1e9, "sysctl hw.memsize"
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            raise RuntimeError(f"cannot read hw.memsize ({e}); set {ENV_MEMORY_GB}") from e
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
                limit = _cgroup_limit_bytes()
                if limit is not None and limit < total:
                    return limit / 1e9, "cgroup memory limit"
                return total / 1e9, "/proc/meminfo"
    except (OSError, ValueError, IndexError):
        pass
    raise RuntimeError(f"cannot read this machine's memory size; set {ENV_MEMORY_GB}")


