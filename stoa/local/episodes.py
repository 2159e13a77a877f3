"""Local mode's multi-turn side: the task's tools, episodes on the backend's own engine, trajectories and
the held-out evaluation of search agents.

A multi-turn task (``stoa.tasks.multiturn.is_multiturn``) samples whole episodes with
``stoa.envs.rollout.sample_episodes`` on the same model object that trains; each episode becomes a
``Trajectory.multi_turn`` (actions, observation tokens with their roles, turns and anchor states), so the batch,
the old/reference logprobs and the loss (ratio, clip, gate and KL on actions; ECHO on echo tokens; GiGPO's
per-token advantages) need nothing else. No torch or mlx here: the backend brings its engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from stoa.algorithms.batch import Trajectory
from stoa.config.local import LocalConfig
from stoa.envs.base import ROLE_ACTION, Tools
from stoa.tasks import Prompt, Task

__all__ = ["collect_episodes", "episode_trajectory", "evaluate_multiturn", "open_local_tools", "turn_of_token"]

EVAL_EPISODE_BATCH = 16
"""Held-out prompts per ``generate_episodes`` call in an evaluation."""


def open_local_tools(task: Any, retriever: str = "", echo: Callable[[str], Any] = print) -> Tools:
    """The tools of a multi-turn task in local mode (there is no bucket).

    Local tools (``walk``) come from the task. A search task's searcher is the ``retriever`` setting (an
    endpoint URL or an index directory, as the worker opens it), else an in-process BM25 index of the task's
    own corpus, built once per task spec and cached (``stoa.trainer.tools.task_index``).

    Args:
        task: a multi-turn task.
        retriever: the ``retriever`` setting ('' for the task's own corpus).
        echo: progress lines (index build, endpoint waits).

    Raises:
        ValueError: a search task without a built-in corpus and no ``retriever`` (the message names the setting).
    """
    from stoa.envs.tools import open_tools

    if task.tool_kind != "search" or retriever:
        return open_tools(task, retriever, note=echo)
    from stoa.trainer.tools import task_index

    index = task_index(task, lambda line: echo(line.replace("[trainer]", "[local]", 1)))
    return open_tools(task, str(index), note=echo)


def turn_of_token(roles: Sequence[int], turn_starts: Sequence[int]) -> np.ndarray:
    """int32 [T]: the model turn of each action token (the last turn start at or before it), -1 elsewhere.

    Args:
        roles: the ``ROLE_*`` of each token of an episode.
        turn_starts: the index of each model turn's first token.
    """
    r = np.asarray(roles, dtype=np.int64)
    turn = np.searchsorted(np.asarray(turn_starts, dtype=np.int64), np.arange(len(r)), side="right") - 1
    return np.where(r == ROLE_ACTION, turn, -1).astype(np.int32)


def episode_trajectory(prompt_tokens: Sequence[int], episode: Any, reward: float) -> Trajectory:
    """The trajectory of one episode: its tokens with their roles, behaviour logprobs, turns and anchor states.

    Args:
        prompt_tokens: the prompt's token ids.
        episode: a ``stoa.engines.episodes.Episode``.
        reward: the task's reward of it.
    """
    n_turns = len(episode.turn_starts)
    return Trajectory.multi_turn(prompt_tokens, episode.tokens, episode.roles, episode.logprobs, reward,
                                 episode.finish_reason, turn_of_token(episode.roles, episode.turn_starts),
                                 tuple(episode.states[:n_turns]))


def collect_episodes(backend: Any, task: Any, codec: Any, tools: Tools,
                     prompts: Sequence[tuple[Prompt, list[int]]], cfg: LocalConfig, seed: int
                     ) -> tuple[list[list[Trajectory]], dict[str, float]]:
    """Multi-turn rollout: ``n_samples`` episodes per prompt on the backend's engine, rewarded by the task.

    Args:
        backend: the model (``engine``, ``sampling``, ``generator``).
        task: the multi-turn task.
        codec: the tokenizer.
        tools: the task's tools (one batched request per round of paused rows).
        prompts: (prompt, token ids) pairs.
        cfg: the run's config (``max_new_tokens`` caps each model turn).
        seed: the sampling seed of this step.

    Returns:
        (the groups, the rollout figures: seconds, sampled tokens, tokens/s, prefill and tool seconds,
        search rate, turns and end reasons).
    """
    from stoa.envs.rollout import episode_metrics, sample_episodes

    with backend.sampling():
        eb = sample_episodes(backend.engine, task, codec, tools, [p for p, _ in prompts], cfg.n_samples,
                             max_turn_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                             generator=backend.generator(seed))
    groups = [[episode_trajectory(ids, e, r) for e, r in zip(g, rs, strict=True)]
              for ids, g, rs in zip(eb.prompt_tokens, eb.groups, eb.rewards, strict=True)]
    sampled = sum(int(np.sum(np.asarray(e.roles) == ROLE_ACTION)) for g in eb.groups for e in g)
    out = {"rollout_s": eb.seconds, "new_tokens": float(sampled),
           "tokens_per_s": sampled / eb.seconds if eb.seconds > 0 else 0.0, "prefill_s": eb.stats.prefill_s,
           "tool_s": float(eb.stats.extra.get("tool_seconds", 0.0)),
           "obs_tokens": float(eb.stats.extra.get("obs_tokens", 0.0))}
    out.update({k.removeprefix("rollout/"): v for k, v in episode_metrics(eb.groups).items()})
    return groups, out


def evaluate_multiturn(backend: Any, task: Task, codec: Any, tools: Tools, cfg: LocalConfig) -> dict[str, float]:
    """Held-out figures of a multi-turn task (``stoa.envs.rollout.evaluate_episodes``) on the backend's engine.

    Greedy episodes give ``eval/accuracy``, ``eval/em``, ``eval/cover_em``, ``eval/search_rate``,
    ``eval/turns_mean`` and the end reasons; with ``eval_k`` > 1, ``eval/pass@k`` over ``eval_k`` episodes per
    prompt sampled at the run's temperature (from the engine's default random stream).

    Args:
        backend: the model.
        task: the multi-turn task.
        codec: the tokenizer.
        tools: the task's tools.
        cfg: the run's config (``eval_n``, ``eval_k``, ``max_new_tokens``, ``temperature``).
    """
    from stoa.envs.rollout import evaluate_episodes

    t0 = time.perf_counter()
    with backend.sampling():
        ev = evaluate_episodes(backend.engine, task, codec, tools, cfg.eval_n, max_turn_tokens=cfg.max_new_tokens,
                               k=cfg.eval_k, temperature=cfg.temperature, batch=EVAL_EPISODE_BATCH)
    ev["seconds"] = time.perf_counter() - t0
    return {f"eval/{k}": float(v) for k, v in ev.items()}
