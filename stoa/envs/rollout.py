"""Sampling multi-turn episodes with any engine: what the worker, the evaluators and local mode all call.

``sample_episodes`` builds one environment per row, drives the engine's ``generate_episodes`` and scores each
episode with the task's verifier; ``episode_sample`` turns an episode into a record's sample;
``episode_metrics`` and ``evaluate_episodes`` give the ``rollout/*`` and ``eval/*`` figures of search agents.
No torch or mlx here: the engine comes in as an argument.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from stoa.envs.base import END_REASONS, Tools, episode_text

if TYPE_CHECKING:
    from stoa.tasks.base import Prompt

__all__ = ["EpisodeBatch", "episode_metrics", "episode_sample", "evaluate_episodes", "sample_episodes"]


@dataclass
class EpisodeBatch:
    """One ``generate_episodes`` call: per prompt its episodes, their rewards and the engine's figures."""

    prompts: list[Prompt]
    prompt_tokens: list[list[int]]
    groups: list[list[Any]]
    """Per prompt, its n ``stoa.engines.episodes.Episode``s."""
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
    from stoa.engines.episodes import EpisodeDriver
    from stoa.tasks.multiturn import episode_limits

    limits = episode_limits(task, max_turn_tokens)
    prompt_tokens = [codec.encode_prompt(p.messages) for p in prompts]
    envs = [task.make_env(p, env_seed) for p in prompts for _ in range(n)]
    driver = EpisodeDriver(envs, tools, codec, limits, codec.eos_ids)
    t0 = time.perf_counter()
    groups, stats = engine.generate_episodes(prompt_tokens, n, driver, temperature=temperature, top_p=top_p,
                                             generator=generator, greedy=greedy)
    seconds = time.perf_counter() - t0
    texts = [[episode_text(e.tokens, e.roles, codec.decode) for e in g] for g in groups]
    rewards = [[float(task.reward(p, t)) for t in ts] for p, ts in zip(prompts, texts, strict=True)]
    return EpisodeBatch(list(prompts), prompt_tokens, groups, rewards, texts, stats, seconds)


def episode_sample(episode: Any, reward: float) -> Any:
    """A record's sample (schema 2) of one episode.

    Args:
        episode: a ``stoa.engines.episodes.Episode``.
        reward: the task's reward of it.
    """
    from stoa.records import Sample

    return Sample(np.array(episode.tokens, np.int32), np.array(episode.logprobs, np.float32), float(reward),
                  episode.finish_reason, roles=np.array(episode.roles, np.uint8),
                  turn_starts=list(episode.turn_starts), calls=list(episode.calls), digests=list(episode.digests),
                  end_reason=episode.end_reason)


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


def evaluate_episodes(engine: Any, task: Any, codec: Any, tools: Tools, n: int, *, max_turn_tokens: int,
                      k: int = 1, temperature: float = 1.0, batch: int = 16) -> dict[str, float]:
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
        ``pass@k`` (with k > 1), ``n`` and ``seconds``.
    """
    prompts = task.heldout(n)
    t0 = time.perf_counter()
    em, cover, correct, eps, passed = [], [], [], [], []
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
            passed += [float(any(task.is_correct(p, t) for t in texts))
                       for p, texts in zip(chunk, sampled.texts, strict=True)]
    out = {"accuracy": float(np.mean(correct)) if correct else 0.0, "em": float(np.mean(em)) if em else 0.0,
           "cover_em": float(np.mean(cover)) if cover else 0.0, "n": float(len(prompts)),
           "seconds": time.perf_counter() - t0}
    out.update({k_.removeprefix("eval/"): v for k_, v in episode_metrics([eps], "eval/").items()})
    if k > 1:
        out[f"pass@{k}"] = float(np.mean(passed)) if passed else 0.0
    return out


def _scores(task: Any, prompt: Prompt, text: str) -> dict[str, float]:
    """EM and cover-EM of one episode text: the task's own ``score`` when it has one, else its verifier."""
    score = getattr(task, "score", None)
    if score is not None:
        s = score(prompt, text)
        return {"em": float(s.em), "cover_em": float(s.cover_em)}
    ok = float(task.is_correct(prompt, text))
    return {"em": ok, "cover_em": ok}
