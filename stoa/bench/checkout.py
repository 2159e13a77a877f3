"""The benchmark scripts that live outside the package: the checkout's ``benchmarks/`` folder (drivers that run
peers such as TRL and mlxrl, and the calibration harnesses), found and loaded by path.

A wheel install has no such folder; asking for one of its scripts then raises :class:`BenchScriptMissing`,
which the CLI prints as one line naming the fix.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
"""The ``benchmarks/`` folder of the checkout this package was imported from (absent in a wheel install)."""

MODULE_PREFIX = "stoa_benchmarks"
"""The ``sys.modules`` prefix of a loaded script (``stoa_benchmarks.trl_compare``), apart from stoa's names."""


class BenchScriptMissing(FileNotFoundError):
    """A script of the checkout's ``benchmarks/`` folder is not there (a wheel install, or a partial copy)."""


def script_path(name: str) -> Path:
    """The path of script ``name`` in the checkout's ``benchmarks/`` folder.

    Args:
        name: the script's file name, e.g. ``trl_driver.py``.

    Raises:
        BenchScriptMissing: the file is not there.
    """
    path = BENCHMARKS_DIR / name
    if not path.is_file():
        raise BenchScriptMissing(
            f"{path} not found: peer drivers and calibration harnesses ship in the benchmarks/ folder of a stoa "
            "checkout, not in the installed package; run from a clone (git clone, then pip install -e .)")
    return path


def load_script(name: str) -> ModuleType:
    """Import script ``name`` of ``benchmarks/`` by path (once; later calls return the same module).

    Args:
        name: the script's file name, e.g. ``quarantine_calibration.py``.

    Raises:
        BenchScriptMissing: the file is not there.
    """
    module_name = f"{MODULE_PREFIX}.{Path(name).stem}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    path = script_path(name)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise BenchScriptMissing(f"{path} is not a Python script; restore it from the stoa checkout")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while the script runs
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
