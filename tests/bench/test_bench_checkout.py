"""The checkout's benchmarks/ folder: its scripts load by path and run under ``stoa bench NAME``; without the folder
(a wheel install) ``stoa bench NAME`` is one line naming the fix, exit 2; no module of the package imports a peer."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from stoa.bench import checkout
from stoa.cli import main
from stoa.cli.bench import BENCHES, load_bench

STOA = Path(__file__).resolve().parents[2] / "stoa"
SCRIPTS = sorted(name for name, (target, _) in BENCHES.items() if target.endswith(".py"))
"""``stoa bench`` names that run a script of benchmarks/."""

PEERS = ("trl", "mlxrl")
"""Packages of the systems stoa is compared with: only the drivers in benchmarks/ import them."""


def test_the_peer_comparisons_and_calibrations_are_scripts_of_the_checkout():
    assert SCRIPTS == ["families", "logprobs", "quarantine", "trl"]
    for name in SCRIPTS:
        mod = load_bench(name)
        assert Path(mod.__file__).parent == checkout.BENCHMARKS_DIR and callable(mod.add_arguments), name
        assert mod.__name__.startswith(f"{checkout.MODULE_PREFIX}.") and load_bench(name) is mod, name


def test_no_module_of_the_package_imports_a_peer():
    found = {}
    for f in sorted(STOA.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            peers = [n for n in names if n.split(".")[0] in PEERS]
            if peers:
                found[f.relative_to(STOA).as_posix()] = peers
    assert found == {}


@pytest.mark.parametrize("argv", [["bench", "quarantine", "--model", "tiny"], ["bench", "trl", "--help"],
                                  ["bench", "local", "--targets", "torch,mlxrl"]])
def test_without_the_benchmarks_folder_it_is_one_line_naming_the_fix(argv, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(checkout, "BENCHMARKS_DIR", tmp_path / "benchmarks")
    for loaded in [k for k in sys.modules if k.startswith(checkout.MODULE_PREFIX)]:
        monkeypatch.delitem(sys.modules, loaded)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "benchmarks" in captured.err and "pip install -e ." in captured.err and "Traceback" not in captured.err
    assert not (tmp_path / "benchmarks").exists()
