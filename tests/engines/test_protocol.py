"""The ``Engine`` protocol: what the package loads, how rows are logged, and the trainer's eval through it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from stoa.engines import Completion, Engine, GenStats, engine_from_model, make_engine
from stoa.engines.base import RowLog
from stoa.episodes.evaluation import greedy_accuracy


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}; import sys; print('\\n'.join(sys.modules))"],
                         capture_output=True, text=True, check=True).stdout
    return {m.split(".")[0] for m in out.split()}


def test_the_package_loads_neither_torch_nor_mlx() -> None:
    mods = _modules_after("import stoa.engines, stoa.engines.sampling, stoa.engines.mlx_blas")
    assert "torch" not in mods and "mlx" not in mods and "transformers" not in mods


def test_row_log_appends_per_row_stops_at_eos_and_groups_by_prompt() -> None:
    log = RowLog(4)  # 2 prompts x 2 samples
    assert log.record([0, 1, 2, 3], [5, 9, 6, 7], [-0.1, -0.2, -0.3, -0.4], {9}) == [0, 2, 3]
    assert log.record([0, 2, 3], [9, 6, 8], [-1.0, -2.0, -3.0], {9}) == [1, 2]
    groups = log.groups(2)
    assert [[c.tokens for c in g] for g in groups] == [[[5, 9], [9]], [[6, 6], [7, 8]]]
    assert [[c.finish_reason for c in g] for g in groups] == [["stop", "stop"], ["length", "length"]]
    assert groups[1][1].logprobs == [-0.4, -3.0]


class _FakeEngine:
    """Answers every prompt with the prompt's last token (a stand-in for any engine)."""

    vocab_size = 100
    dtype_name = "float32"

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def generate_episodes(self, prompts: Sequence[Sequence[int]], n: int, driver: Any, *, temperature: float = 1.0,
                          top_p: float = 1.0, generator: Any = None, greedy: bool = False) -> Any:
        raise AssertionError("single-turn evaluation never runs episodes")

    def generate(self, prompts: Sequence[Sequence[int]], n: int, *, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, eos_ids: Sequence[int] = (),
                 generator: Any = None, greedy: bool = False) -> tuple[list[list[Completion]], GenStats]:
        self.calls.append({"rows": len(prompts), "n": n, "greedy": greedy, "eos": tuple(eos_ids),
                           "max_new_tokens": max_new_tokens})
        groups = [[Completion([p[-1]] if greedy else [0], [-0.5], "stop") for _ in range(n)] for p in prompts]
        return groups, GenStats(new_tokens=len(prompts) * n)

    def load_weights(self, named: Any) -> None:
        raise AssertionError("the trainer's eval never loads weights into its engine")

    def load_state(self, state: Any, plane: str) -> None:
        raise AssertionError("the trainer's eval never loads weights into its engine")

    def make_generator(self, seed: int | None) -> None:
        return None


def test_trainer_eval_runs_any_engine_greedily_in_batches() -> None:
    engine = _FakeEngine()
    assert isinstance(engine, Engine)
    prompts = [SimpleNamespace(id=f"test:{i}", messages=i, answer=str(i % 3)) for i in range(7)]
    task = SimpleNamespace(id="fake", heldout=lambda n: prompts[:n], is_correct=lambda p, text: text == p.answer)
    codec = SimpleNamespace(encode_prompt=lambda m: [1, m % 3], decode=lambda t: str(t[0]), eos_ids=(2,))
    ev = greedy_accuracy(engine, codec, task, n=7, max_new_tokens=5, batch=3)  # type: ignore[arg-type]
    assert ev["accuracy"] == 1.0 and ev["n"] == 7.0 and ev["tokens_per_s"] > 0
    assert [c["rows"] for c in engine.calls] == [3, 3, 1]
    assert all(c["greedy"] and c["n"] == 1 and c["eos"] == (2,) and c["max_new_tokens"] == 5
               for c in engine.calls)


def test_make_engine_names_the_choices() -> None:
    with pytest.raises(ValueError, match="use auto, torch, mlx"):
        make_engine("vllm", "/nowhere")


def test_engine_from_model_refuses_what_no_engine_runs() -> None:
    with pytest.raises(TypeError, match="transformers or mlx-lm"):
        engine_from_model(object())
