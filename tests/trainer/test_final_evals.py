"""The evals a run is judged by (after the cold start, and the last) sample ``eval_k_final`` episodes per prompt
for pass@k; the others keep ``eval_k``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from stoa.config import TrainerConfig
from stoa.config.base import ConfigError


def test_cold_start_and_last_evals_use_eval_k_final_and_the_curve_keeps_eval_k(tmp_path, tiny_dir, monkeypatch):
    from stoa.trainer import closing, loop

    seen: list[int] = []

    def fake_evaluate(model: Any, codec: Any, task: Any, n: int, max_new_tokens: int, **kw: Any) -> dict[str, float]:
        seen.append(kw["k"])
        return {"accuracy": 0.5, "n": float(n), "seconds": 0.0}

    monkeypatch.setattr(closing, "evaluate", fake_evaluate)
    cfg = TrainerConfig(bucket=str(tmp_path / "b"), run="r", model="tiny", task="arithmetic", n_samples=2,
                        eval_n=2, eval_k=2, eval_k_final=5, kl_beta=0.0, groups_per_step=2, poll_seconds=0.01,
                        log_dir="", cold_start="demos", cold_start_steps=1, cold_start_examples=4,
                        cold_start_batch=4, max_new_tokens=8).validate()
    t = loop._Trainer(cfg, echo=lambda _line: None)
    try:
        t.open_lifecycle()
        t.resume()  # evals "before" and "cold start", then v1
        t.evaluate("step 3")
        t.evaluate("after")
        t.metrics.close()
    finally:
        t.close()
    assert seen == [2, 5, 2, 5]
    assert [e["label"] for e in t.summary["evals"]] == ["before", "cold start", "step 3", "after"]


def test_the_last_step_leaves_its_eval_to_the_after_eval_which_samples_pass_at_k(tmp_path, tiny_dir, monkeypatch):
    """With ``eval_every`` dividing ``steps``, the last step's eval is the "after" one (``eval_k_final``), not a
    periodic one that would skip it; a run stopped early at an ``eval_every`` step keeps that step's eval."""
    from stoa.trainer import loop

    cfg = TrainerConfig(bucket=str(tmp_path / "b"), run="r", model="tiny", task="arithmetic", steps=4, eval_every=2,
                        eval_n=2, kl_beta=0.0, log_dir="").validate()
    t = loop._Trainer(cfg, echo=lambda _line: None)
    monkeypatch.setattr(t, "evaluator_running", lambda: False)
    monkeypatch.setattr(t, "evaluate", lambda label: setattr(t, "evaluated_at", t.step))
    try:
        due = {}
        for step in (1, 2, 3, 4):
            t.step = step
            due[step] = t.periodic_eval_due()
        assert due == {1: False, 2: True, 3: False, 4: False}
        assert t.final_eval_due(steps_here=4)  # step 4 had no periodic eval: "after" samples pass@k
        t.step = 2
        t.evaluate("step 2")
        assert not t.final_eval_due(steps_here=2)  # stopped at step 2: its eval stands
        t.step = 3
        assert t.final_eval_due(steps_here=3) and not t.final_eval_due(steps_here=0)
        monkeypatch.setattr(t, "evaluator_running", lambda: True)
        t.step = 2
        assert not t.periodic_eval_due()  # a follow-along evaluator does the curve, the last step's eval too
        t.step = 4
        assert not t.final_eval_due(steps_here=4)
        t.step = 3
        assert t.final_eval_due(steps_here=3)  # off the cadence: the evaluator may never see this version
    finally:
        t.metrics.close()
        t.close()


def test_eval_k_final_zero_means_eval_k_and_negative_is_refused(tmp_path):
    assert TrainerConfig(bucket=str(tmp_path), run="r", model="tiny").validate().eval_k_final == 0
    with pytest.raises(ConfigError, match="eval_k_final"):
        TrainerConfig(bucket=str(tmp_path), run="r", model="tiny", eval_k_final=-1).validate()


def test_demos_on_a_task_that_builds_none_is_one_line_and_no_marker(tmp_path, tiny_dir):
    from stoa.bucket import open_bucket
    from stoa.trainer import loop
    from stoa.trainer.coldstart import read_marker

    cfg = TrainerConfig(bucket=str(tmp_path / "b"), run="r", model="tiny", task="toy", n_samples=2, eval_n=0,
                        kl_beta=0.0, groups_per_step=2, poll_seconds=0.01, log_dir="", cold_start="demos",
                        cold_start_steps=1, max_new_tokens=8).validate()
    t = loop._Trainer(cfg, echo=lambda _line: None)
    try:
        t.open_lifecycle()
        with pytest.raises(SystemExit, match=r"^stoa: cold_start: task 'toy' builds no demonstrations; .*'rft'"):
            t.resume()
    finally:
        t.close()
    assert read_marker(open_bucket(str(tmp_path / "b")), "r") is None


@pytest.mark.parametrize(("dtype", "weights", "want"), [("bfloat16", "autocast", (True, torch.float32)),
                                                       ("bfloat16", "bf16_copy", (False, torch.bfloat16)),
                                                       ("float32", "bf16_copy", (False, torch.float32))])
def test_the_trainer_evaluates_the_forward_it_trains(tmp_path, tiny_dir, monkeypatch, dtype, weights, want):
    """A bf16-autocast policy is evaluated under the same autocast, a bf16-copy one on its bf16 copy (its fp32
    master is a different function)."""
    from stoa.trainer import closing, loop

    seen: list[tuple[bool, torch.dtype]] = []

    def fake_evaluate(model: Any, codec: Any, task: Any, n: int, max_new_tokens: int, **kw: Any) -> dict[str, float]:
        seen.append((torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16,
                     next(model.parameters()).dtype))
        return {"accuracy": 0.5, "n": float(n), "seconds": 0.0}

    monkeypatch.setattr(closing, "evaluate", fake_evaluate)
    cfg = TrainerConfig(bucket=str(tmp_path / "b"), run="r", model="tiny", task="arithmetic", n_samples=2,
                        eval_n=2, kl_beta=0.0, groups_per_step=2, poll_seconds=0.01, log_dir="", dtype=dtype,
                        compute_weights=weights, max_new_tokens=8).validate()
    t = loop._Trainer(cfg, echo=lambda _line: None)
    try:
        t.open_lifecycle()
        t.resume()
        t.metrics.close()
    finally:
        t.close()
    assert seen == [want]
