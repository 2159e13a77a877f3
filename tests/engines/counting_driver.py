"""An episode driver that records what each decode step held: the continuous-batching tests of both engines
(tests/engines/test_torch_slots.py, tests/engines/test_mlx_slots.py) read it."""

from __future__ import annotations

from collections.abc import Sequence

from stoa.episodes.driver import EpisodeDriver


class CountingDriver(EpisodeDriver):
    """Records, at every decode step, the rows it decoded and how many episodes had not been admitted yet."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[tuple[int, int]] = []
        """(rows decoded, episodes still queued) at each step."""
        self.held: list[int] = []
        """Rows decoding or waiting for a tool at each step."""
        self.actives: list[list[int]] = []
        """The rows decoded at each step."""

    def record(self, active: Sequence[int], tokens: Sequence[int], logprobs: Sequence[float]) -> list[int]:
        queued = sum(1 for r in range(self.rows) if not self.episode(r).tokens and r not in set(active))
        self.steps.append((len(active), queued))
        self.held.append(len(active) + len(self.paused))
        self.actives.append(list(active))
        return super().record(active, tokens, logprobs)
