"""The shape of a recorded episode: token roles, why it ended, its limits and its tool calls.

Records carry these (``stoa.rollouts.records``); environments, engines and the trainer's replay produce and
check them (``stoa.envs``, ``stoa.episodes``). Nothing here imports more than the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLE_MASKED = 0
"""Observation or template tokens: no loss of any kind."""
ROLE_ACTION = 1
"""Tokens the policy sampled: ratio, clip, DPPO gate and KL apply to these only."""
ROLE_ECHO = 2
"""Observation tokens the ECHO term may learn to predict (NLL, no ratio, no KL)."""
ROLES = (ROLE_MASKED, ROLE_ACTION, ROLE_ECHO)

END_REASONS = ("stop", "length", "max_turns", "max_obs_tokens", "max_total_tokens")
"""Why an episode ended: ``stop`` the policy ended it (EOS, or a turn without a tool call); ``length`` a turn
reached ``max_turn_tokens``; ``max_turns`` a tool call on the last allowed turn; ``max_obs_tokens`` an
observation longer than its limit; ``max_total_tokens`` the episode's token budget ran out."""


@dataclass(frozen=True)
class EpisodeLimits:
    """Limits of one episode; every limit reached ends the episode with its reason (``END_REASONS``)."""

    max_turns: int = 4
    """Model turns per episode (a tool call on the last one ends the episode with ``max_turns``)."""
    max_turn_tokens: int = 128
    """Tokens the policy may sample in one turn (the contract's ``max_new_tokens``)."""
    max_obs_tokens: int = 512
    """Tokens of one observation; a longer one ends the episode (environments truncate their text first)."""
    max_total_tokens: int = 1536
    """Tokens after the prompt (actions and observations together)."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_turn_tokens", "max_obs_tokens", "max_total_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class ToolCall:
    """A tool call parsed from a model turn."""

    name: str
    """The tool, e.g. ``search``."""
    arguments: str
    """Its argument text, e.g. the query."""
