"""`stoa bench local`: the mlxrl driver is valid Python and the table reports ratios and failed targets."""

from __future__ import annotations

import argparse

from stoa.bench.checkout import script_path
from stoa.bench.local import MLXRL_DRIVER, _table, add_arguments


def test_mlxrl_driver_compiles():
    # It runs in another venv: a syntax error would show only there.
    driver = script_path(MLXRL_DRIVER)
    compile(driver.read_text(), str(driver), "exec")


def _target(step_s: float, tok_s: float, blas: str) -> dict:
    return {"rollout_tok_s": tok_s, "s_per_step": step_s, "it_s": 1 / step_s, "peak_rss_gb": 1.0,
            "allocator_peak_gb": 0.5, "blas": blas}


def test_table_prints_ratios_against_mlxrl_and_names_failures():
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args([])
    results = {"machine": {"cpus": 2, "load_before": (1.0, 1, 1), "load_after": (1.5, 1, 1), "mlx_blas_linux": "mkl"},
               "targets": {"mlxrl (naive rollout)": _target(20.0, 10.0, "mkl"), "torch": _target(5.0, 40.0, "torch"),
                           "mlx": _target(10.0, 20.0, "mkl")},
               "failed": {"other": "boom"}}
    table = _table(results, args)
    assert "torch / mlxrl (naive rollout): it/s 4.00x, rollout tok/s 4.00x" in table
    assert "mlx / mlxrl (naive rollout): it/s 2.00x" in table
    assert "| other | FAILED" in table
