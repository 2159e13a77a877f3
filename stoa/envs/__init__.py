"""Multi-turn environments: the protocol (token in, token out); roles and limits are ``stoa.rollouts.episode``,
episodes ``stoa.episodes``."""

from stoa.envs.base import (
    Environment,
    Observation,
    ToolResult,
    Tools,
    ToolUnavailable,
    action_runs,
    episode_text,
    observation_tokens,
    result_hash,
)

__all__ = [
    "Environment",
    "Observation",
    "ToolResult",
    "ToolUnavailable",
    "Tools",
    "action_runs",
    "episode_text",
    "observation_tokens",
    "result_hash",
]
