"""`stoa bench local`: the mlxrl driver is valid Python, the table reports ratios and failed targets, and a missing
mlxrl venv is one line before anything runs."""

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


def test_a_missing_mlxrl_python_is_one_line_before_any_target_runs(tmp_path, capsys):
    from stoa.cli import main

    argv = ["bench", "local", "--targets", "torch,mlxrl", "--mlxrl-python", str(tmp_path / "none" / "python"),
            "--json", str(tmp_path / "local.json")]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("stoa: invalid setting mlxrl_python: ") and "requirements-mlxrl.txt" in captured.err
    assert not (tmp_path / "local.json").exists()
