"""One evaluation module: greedy figures with or without the reward, the held-out dispatch every caller shares,
and local mode's single-turn eval row through it."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from stoa.engines import Completion, GenStats
from stoa.episodes import evaluation
from stoa.episodes.evaluation import EPISODE_BATCH, evaluate_heldout, greedy_figures

PROMPTS = [SimpleNamespace(id=f"test:{i}", messages=i, answer=str(i % 3)) for i in range(7)]
TASK = SimpleNamespace(id="fake", heldout=lambda n: PROMPTS[:n], is_correct=lambda p, text: text == p.answer,
                       reward=lambda p, text: 2.0 if text == p.answer else 0.5)
CODEC = SimpleNamespace(encode_prompt=lambda m: [1, m], decode=lambda t: str(t[0]), eos_ids=(2,))


def _decode(batches: list[int]) -> Any:
    """Answers prompt i with ``i % 3`` when i is even, else ``9`` (wrong); records each batch's size."""
    def decode(prompt_tokens: list[list[int]]) -> tuple[list[list[Completion]], GenStats]:
        batches.append(len(prompt_tokens))
        groups = [[Completion([p[-1] % 3 if p[-1] % 2 == 0 else 9], [0.0], "stop")] for p in prompt_tokens]
        return groups, GenStats(new_tokens=len(prompt_tokens))
    return decode


def test_greedy_figures_count_correct_answers_and_mean_reward_in_batches() -> None:
    batches: list[int] = []
    ev = greedy_figures(_decode(batches), CODEC, TASK, 7, batch=3, reward=True)  # type: ignore[arg-type]
    assert batches == [3, 3, 1]
    assert ev["accuracy"] == pytest.approx(4 / 7) and ev["n"] == 7.0  # prompts 0, 2, 4, 6
    assert ev["reward_mean"] == pytest.approx((4 * 2.0 + 3 * 0.5) / 7) and ev["tokens_per_s"] > 0
    assert "reward_mean" not in greedy_figures(_decode([]), CODEC, TASK, 7)  # type: ignore[arg-type]


def test_held_out_dispatch_runs_episodes_with_tools_capped_batch_and_greedy_without(monkeypatch) -> None:
    seen: dict[str, Any] = {}

    def episodes(engine: Any, task: Any, codec: Any, tools: Any, n: int, **kw: Any) -> dict[str, float]:
        seen.update(kw, n=n, tools=tools)
        return {"accuracy": 0.25}

    monkeypatch.setattr(evaluation, "evaluate_episodes", episodes)
    tools = object()
    ev = evaluate_heldout(None, CODEC, TASK, 5, 7, tools=tools, k=4, temperature=0.7)  # type: ignore[arg-type]
    assert ev == {"accuracy": 0.25}
    assert seen == {"n": 5, "tools": tools, "max_turn_tokens": 7, "k": 4, "temperature": 0.7,
                    "batch": EPISODE_BATCH}
    evaluate_heldout(None, CODEC, TASK, 5, 7, tools=tools, batch=3)  # type: ignore[arg-type]
    assert seen["batch"] == 3

    class Engine:
        def generate(self, prompts: Sequence[Sequence[int]], n: int, **kw: Any) -> Any:
            assert kw == {"max_new_tokens": 7, "eos_ids": (2,), "greedy": True} and n == 1
            return _decode([])([list(p) for p in prompts])

    ev = evaluate_heldout(Engine(), CODEC, TASK, 7, 7)  # type: ignore[arg-type]
    assert ev["accuracy"] == pytest.approx(4 / 7) and set(ev) == {"accuracy", "n", "seconds", "tokens_per_s"}


def test_local_single_turn_eval_row_keeps_its_keys_and_its_decoding_settings() -> None:
    from stoa.local.backend import derive_seed
    from stoa.local.loop import evaluate

    calls: list[dict[str, Any]] = []

    class Backend:
        def rollout(self, prompts: Sequence[Sequence[int]], n: int, **kw: Any) -> Any:
            calls.append(dict(kw, n=n))
            return _decode([])([list(p) for p in prompts])

    cfg = SimpleNamespace(eval_n=7, max_new_tokens=6, temperature=0.9, seed=11)
    row = evaluate(Backend(), TASK, CODEC, cfg, step=3)  # type: ignore[arg-type]
    assert list(row) == ["eval/accuracy", "eval/reward_mean", "eval/n", "eval/seconds"]
    assert row["eval/accuracy"] == pytest.approx(4 / 7) and row["eval/reward_mean"] == pytest.approx(9.5 / 7)
    assert calls[0] == {"n": 1, "max_new_tokens": 6, "temperature": 0.9, "top_p": 1.0, "eos_ids": (2,),
                        "seed": derive_seed(11, 3, 1), "greedy": True}


def test_episode_eval_reports_pass_at_k_and_the_sampled_share_correct(monkeypatch) -> None:
    """Prompt i's k sampled episodes: the first i % 3 of them correct; greedy: always wrong."""
    k = 4

    def sample(engine: Any, task: Any, codec: Any, tools: Any, chunk: Sequence[Any], n: int, **kw: Any) -> Any:
        if kw.get("greedy"):
            return SimpleNamespace(texts=[["wrong"] for _ in chunk], groups=[[None] for _ in chunk])
        texts = [[p.answer if j < int(p.answer) else "wrong" for j in range(n)] for p in chunk]
        return SimpleNamespace(texts=texts, groups=[[None] * n for _ in chunk])

    monkeypatch.setattr(evaluation, "sample_episodes", sample)
    monkeypatch.setattr(evaluation, "episode_metrics", lambda groups, prefix: {})
    ev = evaluation.evaluate_episodes(None, TASK, CODEC, None, 7, max_turn_tokens=8, k=k, batch=3)  # type: ignore[arg-type]
    answers = [int(p.answer) for p in PROMPTS]  # 0 1 2 0 1 2 0
    assert ev["accuracy"] == 0.0
    assert ev["pass@4"] == pytest.approx(sum(a > 0 for a in answers) / 7)
    assert ev["sampled_accuracy"] == pytest.approx(sum(answers) / (7 * k))
    greedy_only = evaluation.evaluate_episodes(None, TASK, CODEC, None, 7, max_turn_tokens=8)  # type: ignore[arg-type]
    assert "sampled_accuracy" not in greedy_only and not any(key.startswith("pass@") for key in greedy_only)


def test_a_task_with_kinds_of_questions_gets_cover_em_per_kind(monkeypatch) -> None:
    """Greedy answers: prompts 0, 2, 4, 6 right (as ``_decode``); kinds: even ids ``a``, odd ``b``, id 6 ``b``."""
    def sample(engine: Any, task: Any, codec: Any, tools: Any, chunk: Sequence[Any], n: int, **kw: Any) -> Any:
        texts = [[p.answer if int(p.id.split(":")[1]) % 2 == 0 else "wrong"] for p in chunk]
        return SimpleNamespace(texts=texts, groups=[[None] for _ in chunk])

    monkeypatch.setattr(evaluation, "sample_episodes", sample)
    monkeypatch.setattr(evaluation, "episode_metrics", lambda groups, prefix: {})
    kinds = SimpleNamespace(**vars(TASK), prompt_kind=lambda p: "b" if p.id in ("test:1", "test:3", "test:5",
                                                                                   "test:6") else "a")
    ev = evaluation.evaluate_episodes(None, kinds, CODEC, None, 7, max_turn_tokens=8)  # type: ignore[arg-type]
    assert (ev["cover_em_a"], ev["n_a"]) == (1.0, 3.0)  # prompts 0, 2, 4
    assert (ev["cover_em_b"], ev["n_b"]) == (pytest.approx(1 / 4), 4.0)  # prompt 6 of 1, 3, 5, 6
    one = SimpleNamespace(**vars(TASK), prompt_kind=lambda p: "a")
    assert not any(key.startswith("cover_em_") for key in
                   evaluation.evaluate_episodes(None, one, CODEC, None, 7, max_turn_tokens=8))  # type: ignore[arg-type]
