"""MLX's Linux BLAS is set up by the engines package before mlx.core loads, and only there."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from stoa.engines import mlx_blas


def _status_after(code: str, **env: str) -> str:
    script = f"{code}\nfrom stoa.engines.mlx_blas import blas_status\nprint(blas_status())"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         env=os.environ | env)
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(platform.system() != "Linux", reason="MKL is loaded on Linux only")
def test_importing_an_mlx_engine_module_loads_mkl_before_mlx() -> None:
    pytest.importorskip("mlx.core", reason="needs mlx (mlx[cpu] on Linux)")
    # A library that does not exist: the attempt is only made while mlx.core is not loaded yet.
    env = {mlx_blas.ENV_MKL_RT: "/nonexistent/libmkl_rt.so", mlx_blas.ENV_MLX_BLAS: ""}
    for module in ("stoa.engines.mlx.engine", "stoa.engines.mlx.quantized", "stoa.engines.mlx.sampling"):
        status = _status_after(f"import {module}", **env)
        assert status.startswith("reference (loading /nonexistent/libmkl_rt.so failed"), (module, status)
    late = _status_after("import mlx.core\nimport stoa.engines.mlx.engine", **env)
    assert late == "reference"  # mlx.core came first: too late to load a BLAS


def test_blas_status_names_the_library() -> None:
    status = mlx_blas.blas_status()
    if platform.system() == "Linux":
        assert status.startswith(("mkl", "reference", "openblas"))
    else:
        assert status.startswith("platform")

