"""A LoRA policy on two gloo ranks (FSDP2, torchrun) equals the single process: losses, merged export, adapter,
and a checkpoint written sharded and loaded into a fresh policy resumes to the same next step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.dist.lora_main import scenario
from tests.dist.test_dist_step import torchrun

SCRIPT = Path(__file__).with_name("lora_main.py")


@pytest.mark.slow
def test_two_ranks_train_the_adapter_as_one_process_does(tiny_dir, tmp_path):
    out = tmp_path / "two.npz"
    done = torchrun(2, str(SCRIPT), str(tiny_dir), str(out), str(tmp_path / "b2"))
    assert done.returncode == 0, done.stderr[-3000:]
    two = dict(np.load(out))
    one = scenario(str(tiny_dir), str(tmp_path / "b1"))
    assert set(one) == set(two) and any(k.startswith("adapter/") for k in one)
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-5, atol=1e-6)  # the third: after the reload
    worst = max(float(np.abs(one[k] - two[k]).max()) for k in one if k != "loss")
    assert worst < 1e-6
    assert min(float(np.abs(one[k]).max()) for k in one if k.endswith("lora_B.weight")) > 1e-3  # trained for real
