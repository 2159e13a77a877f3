"""Import directions: the worker never imports the trainer, the trainer never imports mlx,
and the contract/config/task/weight modules import neither torch nor mlx."""

from __future__ import annotations

import subprocess
import sys

import pytest


def loaded_after(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


@pytest.mark.parametrize("module", ["stoa.records", "stoa.config", "stoa.tasks", "stoa.weights.store",
                                    "stoa.bucket", "stoa.runfiles", "stoa.algorithms", "stoa.cli"])
def test_contract_modules_import_neither_torch_nor_mlx(module):
    mods = loaded_after(module)
    assert "torch" not in mods and "mlx" not in mods, module


@pytest.mark.parametrize("module", ["stoa.worker.loop", "stoa.worker.engine_torch"])
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
