"""Sampling multi-turn episodes with any engine: what the worker, the trainer's evaluation, the evaluator, local
mode and the benchmarks all call.

``sample_episodes`` builds one environment per row, drives the engine's ``generate_episodes`` with an
``EpisodeDriver`` and scores each episode with the task's verifier. An episode becomes a record's sample
(``episode_sample``, the worker) or a training trajectory (``episode_trajectory``, local mode);
``episode_metrics`` gives the ``rollout/*`` figures of search agents. ``sample_episode_batch`` is the
worker's call (a batch whose tools failed is dropped whole), ``collect_episodes`` local mode's (trajectories
on the backend's own engine). No torch or mlx here: the engine comes in as an argument.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from stoa.algorithms.batch import Trajectory
from stoa.config.local import LocalConfig
from stoa.envs.base import Tools, ToolUnavailable, episode_text
from stoa.episodes.driver import Episode, EpisodeDriver
from stoa.rollouts.episode import END_REASONS, ROLE_ACTION
from stoa.rollouts.records import Sample
from stoa.tasks.base import Prompt
from stoa.tasks.multiturn import episode_limits
from stoa.tasks.scoring import rewards_or_zeros

__all__ = ["EpisodeBatch", "collect_episodes", "episode_metrics", "episode_sample", "episode_trajectory",
           "sample_episode_batch", "sample_episodes", "turn_of_token"]


@dataclass
class EpisodeBatch:
    """One ``generate_episodes`` call: per prompt its episodes, their rewards and the engine's figures."""

    prompts: list[Prompt]
    prompt_tokens: list[list[int]]
    groups: list[list[Any]]
    """Per prompt, its n ``stoa.episodes.driver.Episode``s."""
    rewards: list[list[float]]
    texts: list[list[str]]
    """What the policy wrote in each episode (``episode_text``): the rewards read it."""
    stats: Any
    """The engine's ``GenStats`` (``extra`` holds the driver's turns, tool calls and tool seconds)."""
    seconds: float


def sample_episodes(engine: Any, task: Any, codec: Any, tools: Tools, prompts: Sequence[Prompt], n: int, *,
                    max_turn_tokens: int, temperature: float = 1.0, top_p: float = 1.0, generator: Any = None,
                    greedy: bool = False, env_seed: int = 0) -> EpisodeBatch:
    """Run ``n`` episodes of every prompt in one batch and score them with the task's verifier.

    Args:
        engine: an engine with ``generate_episodes`` (torch or MLX).
        task: the multi-turn task (``make_env``, ``limits``, ``reward``).
        codec: the run's ``TextCodec``.
        tools: the tools every paused row's call goes to (one batched request per round).
        prompts: the prompts (one group each).
        n: episodes per prompt.
        max_turn_tokens: tokens one model turn may sample.
        temperature: sampling temperature.
        top_p: nucleus mass.
        generator: the engine's random source.
        greedy: argmax decoding (evaluation).
        env_seed: the seed every environment is built with (recorded with the group).

    Raises:
        stoa.envs.ToolUnavailable: the tools could not answer; nothing of the batch is usable.
    """
    limits = episode_limits(task, max_turn_tokens)
    prompt_tokens = [codec.encode_prompt(p.messages) for p in prompts]
    envs = [task.make_env(p, env_seed) for p in prompts for _ in range(n)]
    driver = EpisodeDriver(envs, tools, codec, limits, codec.eos_ids)
    t0 = time.perf_counter()
    groups, stats = engine.generate_episodes(prompt_tokens, n, driver, temperature=temperature, top_p=top_p,
                                             generator=generator, greedy=greedy)
    seconds = time.perf_counter() - t0
    texts = [[episode_text(e.tokens, e.roles, codec.decode) for e in g] for g in groups]
    rewards = [rewards_or_zeros(task, p, ts) for p, ts in zip(prompts, texts, strict=True)]
    return EpisodeBatch(list(prompts), prompt_tokens, groups, rewards, texts, stats, seconds)


def episode_sample(episode: Any, reward: float) -> Sample:
    """A record's sample (schema 2) of one episode.

    Args:
        episode: an ``Episode`` (or anything with its fields).
        reward: the task's reward of it.
    """
    return Sample(np.array(episode.tokens, np.int32), np.array(episode.logprobs, np.float32), float(reward),
                  episode.finish_reason, roles=np.array(episode.roles, np.uint8),
                  turn_starts=list(episode.turn_starts), calls=list(episode.calls), digests=list(episode.digests),
                  end_reason=episode.end_reason)


def turn_of_token(roles: Sequence[int], turn_starts: Sequence[int]) -> np.ndarray:
    """int32 [T]: the model turn of each action token (the last turn start at or before it), -1 elsewhere.

    Args:
        roles: the ``ROLE_*`` of each token of an episode.
        turn_starts: the index of each model turn's first token.
    """
    r = np.asarray(roles, dtype=np.int64)
    turn = np.searchsorted(np.asarray(turn_starts, dtype=np.int64), np.arange(len(r)), side="right") - 1
    return np.where(r == ROLE_ACTION, turn, -1).astype(np.int32)


def episode_trajectory(prompt_tokens: Sequence[int], episode: Episode, reward: float) -> Trajectory:
    """The trajectory of one episode: its tokens with their roles, behaviour logprobs, turns and anchor states.

    Args:
        prompt_tokens: the prompt's token ids.
        episode: the episode.
        reward: the task's reward of it.
    """
    n_turns = len(episode.turn_starts)
    return Trajectory.multi_turn(prompt_tokens, episode.tokens, episode.roles, episode.logprobs, reward,
                                 episode.finish_reason, turn_of_token(episode.roles, episode.turn_starts),
                                 tuple(episode.states[:n_turns]))


def episode_metrics(groups: Sequence[Sequence[Any]], prefix: str = "rollout/") -> dict[str, float]:
    """Search rate, turns and end reasons of some episodes.

    ``search_rate`` is the share of episodes that made at least one tool call, ``turns_mean`` the mean model
    turns, ``tool_calls_mean`` the mean calls, ``end/<reason>`` the share of episodes that ended so.

    Args:
        groups: episodes (anything with ``calls``, ``turn_starts`` and ``end_reason``), grouped or not.
        prefix: the metric names' prefix.
    """
    eps = [e for g in groups for e in g]
    if not eps:
        return {}
    ends = Counter(e.end_reason for e in eps)
    out = {f"{prefix}search_rate": float(np.mean([len(e.calls) > 0 for e in eps])),
           f"{prefix}turns_mean": float(np.mean([len(e.turn_starts) for e in eps])),
           f"{prefix}tool_calls_mean": float(np.mean([len(e.calls) for e in eps]))}
    for reason in END_REASONS:
        out[f"{prefix}end/{reason}"] = ends.get(reason, 0) / len(eps)
    return out


def sample_episode_batch(engine: Any, task: Any, codec: Any, tools: Any, contract: Any, prompts: Sequence[Any],
                         generator: Any, metrics: Any = None) -> EpisodeBatch | None:
    """The worker's episodes: the contract's ``n_samples`` of each prompt; None when the tools could not answer.

    A batch whose tools failed is dropped whole, so no record ever holds a missing observation; the caller
    waits and samples again.

    Args:
        engine: the worker's engine.
        task: the multi-turn task.
        codec: the run's tokenizer.
        tools: the task's tools.
        contract: the run contract (group size, sampling).
        prompts: the prompts of this batch.
        generator: the engine's random source.
        metrics: the worker's ``MetricsWriter`` (episode figures are logged to it), or None.
    """
    sp = contract.sampling
    try:
        batch = sample_episodes(engine, task, codec, tools, prompts, contract.n_samples,
                                max_turn_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p,
                                generator=generator)
    except ToolUnavailable as e:
        print(f"[worker] tools unavailable ({e}); dropped this batch, waiting before sampling again", flush=True)
        if metrics is not None:
            metrics.log({"worker/tool_unavailable": 1})
        return None
    if metrics is not None:
        figures = episode_metrics(batch.groups, "worker/")
        figures["worker/tool_seconds"] = float(batch.stats.extra.get("tool_seconds", 0.0))
        metrics.log(figures)
    return batch


def collect_episodes(backend: Any, task: Any, codec: Any, tools: Tools,
                     prompts: Sequence[tuple[Prompt, list[int]]], cfg: LocalConfig, seed: int
                     ) -> tuple[list[list[Trajectory]], dict[str, float]]:
    """Local mode's rollout: ``n_samples`` episodes per prompt on the backend's engine, as trajectories.

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
