"""Import direction: the config/contract side loads no backend; concrete modules load only on request."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import HAS_MLX


def _run(code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_base_imports_neither_torch_nor_mlx() -> None:
    _run(
        "import sys\n"
        "import stoa.algorithms.base, stoa.algorithms\n"
        "stoa.algorithms.AlgoConfig.from_dict({'name': 'dapo'})\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'mlx')]\n"
        "assert not bad, bad\n"
        "names = ('grpo', 'dr_grpo', 'dapo', 'gspo', 'rloo', 'cispo', 'gigpo')\n"
        "concrete = [m for m in sys.modules if m.rsplit('.', 1)[-1] in names]\n"
        "assert not concrete, concrete\n"
    )


def test_shared_math_and_algorithms_are_backend_free() -> None:
    _run(
        "import sys\n"
        "import stoa.algorithms.core, stoa.algorithms.bases, stoa.algorithms.advantages\n"
        "import stoa.algorithms.grpo, stoa.algorithms.dr_grpo, stoa.algorithms.dapo\n"
        "import stoa.algorithms.gspo, stoa.algorithms.rloo, stoa.algorithms.cispo, stoa.algorithms.gigpo\n"
        "import stoa.algorithms.diagnostics, stoa.algorithms.batch\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'mlx')]\n"
        "assert not bad, bad\n"
    )


@pytest.mark.mlx
@pytest.mark.skipif(not HAS_MLX, reason="mlx is not importable")
def test_mlx_backend_does_not_pull_torch() -> None:
    _run(
        "import sys\n"
        "from stoa.algorithms import AlgoConfig, get_algorithm\n"
        "get_algorithm(AlgoConfig.preset('grpo'), 'mlx')\n"
        "assert 'torch' not in sys.modules\n"
        "assert 'mlx.core' in sys.modules\n"
    )
