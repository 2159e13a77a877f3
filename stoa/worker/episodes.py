"""The worker's multi-turn sampling: episodes with the task's tools, waiting out a retriever that is down."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from stoa.envs import ToolUnavailable
from stoa.envs.rollout import EpisodeBatch, episode_metrics, sample_episodes

log = logging.getLogger(__name__)


def sample_episode_batch(engine: Any, task: Any, codec: Any, tools: Any, contract: Any, prompts: Sequence[Any],
                         generator: Any, metrics: Any = None) -> EpisodeBatch | None:
    """Run the contract's ``n_samples`` episodes of each prompt; None when the tools could not answer.

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
