"""Held-out evaluation, one loop for every caller: greedy accuracy of single-turn tasks, and for multi-turn
tasks greedy EM and cover-EM, search rate, turns and pass@k of sampled episodes.

The trainer (``stoa.trainer.setup.evaluate``), the evaluator (``stoa eval --follow``), local mode and the
benchmarks call these with their own settings (held-out prompts, token caps, temperature, batch); the
figures and how they are computed live here. No torch or mlx: the engine comes in as an argument.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from stoa.envs.base import Tools
from stoa.episodes.collect import episode_metrics, sample_episodes
from stoa.tasks.base import Prompt, RewardError, Task
from stoa.tasks.scoring import judge, score_group

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # the engines import this package's driver; an engine comes in as an argument
    from stoa.engines.base import Engine, GenStats

__all__ = ["EPISODE_BATCH", "evaluate_episodes", "evaluate_heldout", "greedy_accuracy", "greedy_figures"]

EPISODE_BATCH = 16
"""Most held-out prompts per ``generate_episodes`` call in an evaluation."""

class GreedyDecode(Protocol):
    """Decodes one greedy completion per prompt (an engine's ``generate``, a backend's ``rollout``)."""

    def __call__(self, prompt_tokens: list[list[int]], /) -> tuple[Sequence[Sequence[Any]], GenStats]:
        """Per prompt its completion (``tokens``), and the decode's ``GenStats`` (``new_tokens``)."""
        ...


def greedy_figures(decode: GreedyDecode, codec: Any, task: Task, n: int, batch: int = 32, *,
                   reward: bool = False) -> dict[str, float]:
    """Greedy held-out figures of a single-turn task on its first ``n`` held-out prompts.

    Args:
        decode: decodes one greedy completion per prompt (an engine's ``generate``, a backend's ``rollout``).
        codec: tokenizer (``encode_prompt``, ``decode``).
        task: the task.
        n: number of held-out prompts.
        batch: prompts decoded together.
        reward: also give ``reward_mean``, the task's mean reward of the completions.

    Returns:
        ``accuracy``, ``n`` (prompts), ``seconds``, ``tokens_per_s`` and, with ``reward``, ``reward_mean``.
    """
    prompts = task.heldout(n)
    correct, total, t0, new_tokens, failed = 0, 0.0, time.perf_counter(), 0, 0
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        groups, st = decode([codec.encode_prompt(p.messages) for p in chunk])
        new_tokens += st.new_tokens
        for p, g in zip(chunk, groups, strict=True):
            text = codec.decode(g[0].tokens)
            try:
                correct += judge(task, p, text)
                total += score_group(task, p, [text])[0] if reward else 0.0
            except RewardError as e:  # the task's reward code failed on this completion: it scores 0
                failed += 1
                log.warning("held-out %s scored 0: %s", p.id, e)
    dt = time.perf_counter() - t0
    out = {"accuracy": correct / max(len(prompts), 1), "n": float(len(prompts)), "seconds": dt,
           "tokens_per_s": new_tokens / dt if dt > 0 else 0.0}
    if failed:
        out["reward_errors"] = float(failed)
    if reward:
        out["reward_mean"] = total / max(len(prompts), 1)
    return out


def greedy_accuracy(engine: Engine, codec: Any, task: Task, n: int, max_new_tokens: int,
                    batch: int = 32) -> dict[str, float]:
    """Greedy held-out accuracy of any engine on the task's first ``n`` held-out prompts.

    Args:
        engine: the engine to decode with (one completion per prompt, argmax, the task's EOS).
        codec: tokenizer.
        task: the task.
        n: number of held-out prompts.
        max_new_tokens: length cap.
        batch: prompts decoded together.

    Returns:
        ``accuracy``, ``n`` (prompts), ``seconds`` and ``tokens_per_s``.
    """
    def decode(prompt_tokens: list[list[int]]) -> tuple[Sequence[Sequence[Any]], GenStats]:
        return engine.generate(prompt_tokens, 1, max_new_tokens=max_new_tokens, eos_ids=codec.eos_ids, greedy=True)

    return greedy_figures(decode, codec, task, n, batch)


def evaluate_episodes(engine: Any, task: Any, codec: Any, tools: Tools, n: int, *, max_turn_tokens: int,
                      k: int = 1, temperature: float = 1.0, batch: int = EPISODE_BATCH) -> dict[str, float]:
    """Held-out figures of a search agent: greedy EM and cover-EM, pass@k of ``k`` sampled episodes.

    Args:
        engine: the engine to run episodes with.
        task: the multi-turn task (``heldout``; ``score``: per-text ``em``/``cover_em``, else ``is_correct``).
        codec: the run's ``TextCodec``.
        tools: the tools.
        n: held-out prompts.
        max_turn_tokens: tokens one model turn may sample.
        k: sampled episodes per prompt for pass@k (1: greedy only).
        temperature: sampling temperature of the pass@k episodes.
        batch: prompts per ``generate_episodes`` call.

    Returns:
        ``accuracy`` (greedy, the task's ``is_correct``), ``em``, ``cover_em``, ``search_rate``, ``turns_mean``,
        ``pass@k`` and ``sampled_accuracy`` (the share of the ``k`` sampled episodes that are correct; with
        k > 1), ``n`` and ``seconds``.
    """
    prompts = task.heldout(n)
    t0 = time.perf_counter()
    em, cover, correct, eps, passed, sampled_ok = [], [], [], [], [], []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        greedy = sample_episodes(engine, task, codec, tools, chunk, 1, max_turn_tokens=max_turn_tokens,
                                 temperature=temperature, greedy=True)
        for p, texts, g in zip(chunk, greedy.texts, greedy.groups, strict=True):
            s = _scores(task, p, texts[0])
            em.append(s["em"])
            cover.append(s["cover_em"])
            correct.append(float(task.is_correct(p, texts[0])))
            eps.append(g[0])
        if k > 1:
            sampled = sample_episodes(engine, task, codec, tools, chunk, k, max_turn_tokens=max_turn_tokens,
                                      temperature=temperature)
            ok = [[float(task.is_correct(p, t)) for t in texts] for p, texts in zip(chunk, sampled.texts, strict=True)]
            passed += [max(row) for row in ok]
            sampled_ok += [x for row in ok for x in row]
    out = {"accuracy": float(np.mean(correct)) if correct else 0.0, "em": float(np.mean(em)) if em else 0.0,
           "cover_em": float(np.mean(cover)) if cover else 0.0, "n": float(len(prompts)),
           "seconds": time.perf_counter() - t0}
    out.update({k_.removeprefix("eval/"): v for k_, v in episode_metrics([eps], "eval/").items()})
    out.update(_by_kind(task, prompts, cover))
    if k > 1:
        out[f"pass@{k}"] = float(np.mean(passed)) if passed else 0.0
        out["sampled_accuracy"] = float(np.mean(sampled_ok)) if sampled_ok else 0.0
    return out


def evaluate_heldout(engine: Engine, codec: Any, task: Task, n: int, max_new_tokens: int, *,
                     tools: Tools | None = None, k: int = 1, temperature: float = 1.0,
                     batch: int = 32) -> dict[str, float]:
    """Held-out figures of any task on one engine: :func:`evaluate_episodes` with tools, else
    :func:`greedy_accuracy`.

    Args:
        engine: the engine.
        codec: tokenizer.
        task: the task.
        n: held-out prompts.
        max_new_tokens: length cap (of each model turn in an episode).
        tools: a multi-turn task's tools (None: single-turn).
        k: sampled episodes per prompt for pass@k (multi-turn; 1: greedy only).
        temperature: sampling temperature of the pass@k episodes.
        batch: prompts decoded together (episodes: at most ``EPISODE_BATCH``).
    """
    if tools is not None:
        return evaluate_episodes(engine, task, codec, tools, n, max_turn_tokens=max_new_tokens, k=k,
                                 temperature=temperature, batch=min(batch, EPISODE_BATCH))
    return greedy_accuracy(engine, codec, task, n, max_new_tokens, batch)


def _by_kind(task: Any, prompts: Sequence[Prompt], cover: Sequence[float]) -> dict[str, float]:
    """``cover_em_<kind>`` per kind of question of a task that tells them apart (``prompt_kind``, e.g. the
    built-in search task's ``1hop`` / ``2hop``), and ``n_<kind>``; {} for a task with one kind."""
    kind_of = getattr(task, "prompt_kind", None)
    if kind_of is None:
        return {}
    kinds = [str(kind_of(p)) for p in prompts]
    if len(set(kinds)) < 2:
        return {}
    out: dict[str, float] = {}
    for kind in sorted(set(kinds)):
        picked = [c for c, k in zip(cover, kinds, strict=True) if k == kind]
        out[f"cover_em_{kind}"], out[f"n_{kind}"] = float(np.mean(picked)), float(len(picked))
    return out


def _scores(task: Any, prompt: Prompt, text: str) -> dict[str, float]:
    """EM and cover-EM of one episode text: the task's own ``score`` when it has one, else its verifier."""
    score = getattr(task, "score", None)
    if score is not None:
        s = score(prompt, text)
        return {"em": float(s.em), "cover_em": float(s.cover_em)}
    ok = float(task.is_correct(prompt, text))
    return {"em": ok, "cover_em": ok}
