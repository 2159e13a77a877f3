"""Fixtures for the local-mode tests: tiny-model configs and built backends (torch; MLX where importable)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoa.config.local import LocalConfig, load_local_config


@pytest.fixture
def make_cfg(tiny_dir: Path, tmp_path: Path) -> Callable[..., LocalConfig]:
    """A validated tiny-model config (toy task, short completions, one torch thread); kwargs override."""

    def make(**kw: Any) -> LocalConfig:
        base = {"model": str(tiny_dir), "task": "toy", "backend": "torch", "threads": 1, "eval_n": 0,
                "n_samples": 4, "groups_per_step": 2, "max_new_tokens": 8, "max_prompt_tokens": 64,
                "output_dir": str(tmp_path / "run"), "checkpoint_every": 0}
        return load_local_config(None, {**base, **kw})

    return make


def sample_batch(backend: Any, algo: Any, *, env_tokens: bool = False, seed: int = 0) -> Any:
    """A batch from a real rollout of two prompts; rewards vary within each group.

    With ``env_tokens`` every row gets three extra tokens in the middle that the policy did not sample
    (action mask 0), the shape of a multi-turn trajectory.
    """
    from stoa.algorithms.batch import Trajectory, filter_and_build

    prompts = [[1, 5, 9, 13], [2, 7, 11]]
    groups, _ = backend.rollout(prompts, 4, max_new_tokens=6, temperature=1.0, top_p=1.0, eos_ids=[], seed=seed)
    rng = np.random.default_rng(seed)
    trajs = []
    for p, group in zip(prompts, groups, strict=True):
        row = []
        for c in group:
            t = Trajectory.single_turn(p, c.tokens, c.logprobs, float(rng.random()), c.finish_reason)
            if env_tokens:
                half = len(t.tokens) // 2
                t = Trajectory(t.prompt, np.concatenate([t.tokens[:half], [3, 4, 6], t.tokens[half:]]),
                               np.concatenate([t.action_mask[:half], np.zeros(3, np.float32), t.action_mask[half:]]),
                               t.reward, t.finish_reason,
                               np.concatenate([t.rollout_logprobs[:half], np.zeros(3, np.float32),
                                               t.rollout_logprobs[half:]]))
            row.append(t)
        trajs.append(row)
    batch, _ = filter_and_build(trajs, algo)
    assert batch is not None
    return batch


@pytest.fixture(scope="session")
def mlx_available() -> None:
    """Skip unless mlx imports (mlx[cpu] on Linux)."""
    pytest.importorskip("mlx.core", reason="needs mlx (mlx[cpu] on Linux)")
