"""Import directions: the worker never imports the trainer, the trainer never imports mlx,
the contract/config/task/weight modules import neither torch nor mlx, the trainer, local mode and
benchmarks take engines from ``stoa.engines``; and only ``stoa/layout.py`` spells a ``runs/`` key."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import import_graph

STOA = Path(__file__).resolve().parent.parent / "stoa"


def loaded_after(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


@pytest.mark.parametrize("module", ["stoa.rollouts.records", "stoa.contract", "stoa.layout", "stoa.config",
                                    "stoa.tasks", "stoa.weights.publish",
                                    "stoa.weights.sync", "stoa.bucket",
                                    "stoa.algorithms", "stoa.algorithms.batch", "stoa.stopflag", "stoa.cli"])
def test_contract_modules_import_neither_torch_nor_mlx(module):
    mods = loaded_after(module)
    assert "torch" not in mods and "mlx" not in mods, module


@pytest.mark.parametrize("module", ["stoa.worker.loop", "stoa.engines.torch"])
def test_worker_never_imports_trainer(module):
    mods = loaded_after(module)
    assert not any(m.startswith("stoa.trainer") for m in mods)


def test_worker_source_never_imports_trainer():
    from pathlib import Path

    import stoa.worker

    for f in Path(stoa.worker.__file__).parent.glob("*.py"):
        assert "stoa.trainer" not in f.read_text(), f


def test_trainer_never_imports_mlx():
    from pathlib import Path

    import stoa.trainer

    for f in Path(stoa.trainer.__file__).parent.glob("*.py"):
        text = f.read_text()
        assert "import mlx" not in text and "from mlx" not in text, f
    mods = loaded_after("stoa.trainer.loop")
    assert "mlx" not in mods


_RUNS_BEFORE_VALUE = re.compile(r"(?:\A|[^\w/])runs/\Z")
RUNS_KEY_PENDING: dict[str, str] = {}
"""Files that still spell a key until a sweep rewrites them; strict xfail, so drop an entry once fixed."""


def runs_key_literals(source: str) -> list[int]:
    """Lines of string literals that build a ``runs/`` key: a string starting with ``runs/``, or an
    f-string with ``runs/{...}`` anywhere (docstrings that mention a key mid-sentence are fine)."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("runs/"):
            hits.append(node.lineno)
        elif isinstance(node, ast.JoinedStr):
            for part, nxt in zip(node.values, node.values[1:], strict=False):
                if (isinstance(part, ast.Constant) and isinstance(nxt, ast.FormattedValue)
                        and _RUNS_BEFORE_VALUE.search(part.value)):
                    hits.append(node.lineno)
    return sorted(set(hits))


def test_runs_key_check_sees_every_spelling():
    spelled = 'a = "runs/x"\nb = f"runs/{r}/m"\nc = f"see {e}; restore runs/{r}/trainer"\nd = "runs/" + r\n'
    assert runs_key_literals(spelled) == [1, 2, 3, 4]
    fine = '"""Keys live under runs/<run>/."""\nhelp = "names runs/<run>/ in the bucket"\nx = f"reruns/{r}"\n'
    assert runs_key_literals(fine) == []


def _stoa_sources() -> list:
    out = []
    for f in sorted(STOA.rglob("*.py")):
        rel = f.relative_to(STOA).as_posix()
        if rel == "layout.py":
            continue
        marks = [pytest.mark.xfail(reason=RUNS_KEY_PENDING[rel], strict=True)] if rel in RUNS_KEY_PENDING else []
        out.append(pytest.param(rel, marks=marks, id=rel))
    return out


@pytest.mark.parametrize("rel", _stoa_sources())
def test_only_layout_spells_run_keys(rel):
    hits = runs_key_literals((STOA / rel).read_text())
    assert not hits, f"stoa/{rel} lines {hits} spell a runs/ key; use a function of stoa.layout"


def imported_modules(source: str) -> set[str]:
    """Every module an import statement names (``from a import b`` yields ``a`` and ``a.b``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


WORKER_NOT_ENGINES = ("stoa.worker.pacing",)
"""Worker modules a benchmark may drive (``stoa bench flood`` runs the workers' pacing); no engine lives there."""


@pytest.mark.parametrize("package", ["trainer", "local", "bench"])
def test_engines_come_from_stoa_engines(package):
    bad = {}
    for f in sorted((STOA / package).rglob("*.py")):
        mods = {m for m in imported_modules(f.read_text())
                if (m == "stoa.worker" or m.startswith("stoa.worker.")) and not m.startswith(WORKER_NOT_ENGINES)}
        if mods:
            bad[f.relative_to(STOA).as_posix()] = sorted(mods)
    assert not bad, f"import engines from stoa.engines, not stoa.worker: {bad}"


@pytest.mark.parametrize("line", ["import stoa.worker.tiers", "from stoa.worker.loop import make_engine",
                                  "from stoa import worker", "import stoa.worker as w"])
def test_import_check_sees_every_form(line):
    assert any(m == "stoa.worker" or m.startswith("stoa.worker.") for m in imported_modules(line)), line


# The import graph (tests/import_graph.py): layers from the foundation up, no cycles, lazy imports only where
# they save loading a heavy or optional package.


def test_every_room_has_a_layer():
    rooms = {import_graph.room(m) for m in import_graph.modules()}
    assert rooms <= set().union(*import_graph.LAYERS), rooms - set().union(*import_graph.LAYERS)


def test_imports_go_down_the_layers():
    bad = import_graph.layer_violations(import_graph.imports())
    assert not bad, "an import goes up the layers of tests/import_graph.py:\n" + "\n".join(bad)


def test_no_import_cycles():
    assert import_graph.cycles(import_graph.imports()) == []


def test_imports_inside_functions_save_a_heavy_or_optional_import():
    bad = import_graph.lazy_violations(import_graph.imports(), import_graph.base_dependencies())
    assert not bad, "move these imports to the top of their module:\n" + "\n".join(bad)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "stoa"
    for rel, text in {"__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_graph_checks_see_each_kind_of_break(tmp_path):
    root = _tree(tmp_path, {
        "layout.py": "import json\n\ndef f():\n    import re\n    from stoa import bucket\n",
        "bucket/__init__.py": "from stoa.bucket.s3 import S3\n",
        "bucket/s3.py": "def g():\n    import obstore\n    from stoa.bucket import S3\nS3 = 1\n",
        "worker/__init__.py": "", "worker/loop.py": "from stoa.trainer import pool\n",
        "trainer/__init__.py": "", "trainer/pool.py": "from stoa.layout import f\n",
        "trainer/heavy.py": "import torch\n",
        "cli/__init__.py": "def main():\n    from stoa.trainer import heavy\n    from stoa.trainer import pool\n",
        "models/__init__.py": "try:\n    from stoa.cli import main\nexcept ImportError:\n    main = None\n",
    })
    imps = import_graph.imports(root)
    base = frozenset({"numpy"})
    assert sorted(import_graph.layer_violations(imps)) == [
        "stoa.layout:5 imports stoa.bucket (layer 0 -> 1)",
        "stoa.models:2 imports stoa.cli (layer 0 -> 7)",
        "stoa.worker.loop:1 imports stoa.trainer.pool (layer 5 -> 5)"]
    assert import_graph.heavy(imps, base) == {"stoa.trainer.heavy"}
    assert sorted(import_graph.lazy_violations(imps, base)) == [
        "stoa.bucket.s3:3 imports stoa.bucket inside a function",
        "stoa.cli:3 imports stoa.trainer.pool inside a function",
        "stoa.layout:4 imports re inside a function",
        "stoa.layout:5 imports stoa.bucket inside a function"]
    assert import_graph.cycles(imps) == [["stoa.bucket", "stoa.bucket.s3"]]


def test_base_dependencies_are_the_project_dependencies():
    assert {"numpy", "safetensors", "xxhash", "zstandard", "tokenizers"} <= import_graph.base_dependencies()
    assert not import_graph.is_optional("numpy", import_graph.base_dependencies())
    assert import_graph.is_optional("torch", import_graph.base_dependencies())
    assert import_graph.is_optional("safetensors.torch", import_graph.base_dependencies())
    assert not import_graph.is_optional("safetensors.numpy", import_graph.base_dependencies())
    assert not import_graph.is_optional("json", import_graph.base_dependencies())
