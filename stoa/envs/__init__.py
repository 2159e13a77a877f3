"""Multi-turn environments: the protocol (token in, token out), roles and limits (episodes: ``stoa.episodes``)."""

from stoa.envs.base import (
    END_REASONS,
    ROLE_ACTION,
    ROLE_ECHO,
    ROLE_MASKED,
    ROLES,
    Environment,
    EpisodeLimits,
    Observation,
    ToolCall,
    ToolResult,
    Tools,
    ToolUnavailable,
    action_runs,
    episode_text,
    observation_tokens,
    result_hash,
)

__all__ = [
    "END_REASONS",
    "ROLES",
    "ROLE_ACTION",
    "ROLE_ECHO",
    "ROLE_MASKED",
    "Environment",
    "EpisodeLimits",
    "Observation",
    "ToolCall",
    "ToolResult",
    "ToolUnavailable",
    "Tools",
    "action_runs",
    "episode_text",
    "observation_tokens",
    "result_hash",
]
