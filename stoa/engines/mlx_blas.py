"""MLX's CPU BLAS on Linux: load Intel MKL before MLX, say which BLAS MLX uses (stdlib only, no mlx import).

``stoa.engines.mlx`` calls :func:`prepare_mlx_blas` once, before any of its modules imports ``mlx.core``;
nothing else needs to. ``stoa worker --print-tier`` and the benchmarks read :func:`blas_status`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import platform
import sys
import warnings
from pathlib import Path

ENV_MLX_BLAS = "STOA_MLX_BLAS"
ENV_MKL_RT = "STOA_MKL_RT"

_BLAS_WARNED = False
_BLAS_STATUS: str | None = None


def find_mkl_rt() -> str | None:
    """Path of Intel MKL's ``libmkl_rt`` (``STOA_MKL_RT``, the environment's ``lib/``, the loader path), or
    None."""
    explicit = os.environ.get(ENV_MKL_RT, "").strip()
    if explicit:
        return explicit
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix, os.path.expanduser("~/.local"))):
        hits = sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")))
        if hits:
            return hits[-1]
    return ctypes.util.find_library("mkl_rt")


def _mapped_libraries() -> str:
    try:
        return Path("/proc/self/maps").read_text()
    except OSError:
        return ""


def prepare_mlx_blas() -> str:
    """Give MLX a fast CPU BLAS on Linux; call before the first ``import mlx.core`` of the process.

    The Linux ``mlx[cpu]`` wheel links the reference (netlib) BLAS: about 5-8 GFLOP/s fp32 matmul on one
    core. When Intel MKL is installed (``pip install mkl``; found in the environment's ``lib/`` or at
    ``STOA_MKL_RT``), its ``libmkl_rt`` is loaded with ``RTLD_GLOBAL`` so MLX's ``cblas_*`` calls bind to it
    (sequential threading unless ``MKL_THREADING_LAYER`` is set). ``STOA_MLX_BLAS=reference`` opts out.
    Does nothing on macOS (Metal and Accelerate) or once MLX is loaded.

    Returns:
        the status string :func:`blas_status` reports.
    """
    global _BLAS_STATUS
    if _BLAS_STATUS is not None:
        return _BLAS_STATUS
    if platform.system() != "Linux":
        _BLAS_STATUS = "platform (Metal/Accelerate)" if sys.platform == "darwin" else "platform"
        return _BLAS_STATUS
    if "libmkl_rt" in _mapped_libraries():
        _BLAS_STATUS = "mkl (already loaded)"
        return _BLAS_STATUS
    if "mlx.core" in sys.modules or os.environ.get(ENV_MLX_BLAS, "").strip().lower() == "reference":
        _BLAS_STATUS = _status_from_maps()
        return _BLAS_STATUS
    path = find_mkl_rt()
    if path:
        os.environ.setdefault("MKL_THREADING_LAYER", "SEQUENTIAL")
        try:
            ctypes.CDLL(path, mode=os.RTLD_GLOBAL | os.RTLD_NOW)
            _BLAS_STATUS = f"mkl ({path}, threading {os.environ['MKL_THREADING_LAYER'].lower()})"
            return _BLAS_STATUS
        except OSError as e:
            _BLAS_STATUS = f"reference (loading {path} failed: {e})"
            return _BLAS_STATUS
    _BLAS_STATUS = "reference"
    return _BLAS_STATUS


def _status_from_maps() -> str:
    maps = _mapped_libraries()
    if "libmkl_rt" in maps:
        return "mkl (already loaded)"
    if "libopenblas" in maps.replace("scipy_openblas", ""):
        return "openblas"
    return "reference"


def blas_status() -> str:
    """Which CPU BLAS MLX uses (or will use) in this process: ``mkl (...)``, ``reference``, ``openblas``, ...

    On Linux before MLX is loaded this is what :func:`prepare_mlx_blas` would do.
    """
    if _BLAS_STATUS is not None:
        return _BLAS_STATUS
    if platform.system() != "Linux":
        return "platform (Metal/Accelerate)" if sys.platform == "darwin" else "platform"
    if "mlx.core" in sys.modules:
        return _status_from_maps()
    path = find_mkl_rt()
    return f"mkl available at {path} (loaded when the MLX engine starts)" if path else "reference"


def warn_if_slow_blas() -> None:
    """Warn once per process when MLX runs on Linux's reference BLAS, with the fix."""
    global _BLAS_WARNED
    if _BLAS_WARNED or platform.system() != "Linux":
        return
    if blas_status().startswith("reference"):
        _BLAS_WARNED = True
        warnings.warn(
            "MLX on Linux is using the reference BLAS of the mlx[cpu] wheel (~5-8 GFLOP/s fp32 matmul); "
            "generation runs 4-16x slower than with Intel MKL. Fix: `pip install mkl` in this environment "
            f"(stoa loads it before MLX; or point {ENV_MKL_RT} at libmkl_rt.so). Linux workers normally use "
            "the torch engine. See docs/mlx.md.",
            RuntimeWarning,
            stacklevel=3,
        )
