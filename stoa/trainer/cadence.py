"""When the trainer checkpoints, and what that costs a bucket.

A checkpoint holds the fp32 master weights and AdamW's two moments: 12 bytes per parameter, plus DCP's headers
(about 2 KB for each parameter tensor, moment and step count: 8 KB per parameter tensor, ~2 MB for SmolLM2-135M's
272; measured on the tiny model, ``tests/test_checkpoint_policy.py``). The trainer saves one
every ``checkpoint_every`` steps and/or once ``checkpoint_minutes`` have passed since its last one, and always
after the run's last step when it finishes or stops on SIGINT/SIGTERM. The published weights (every version)
already carry the weights to workers; a checkpoint adds the optimizer state and the fp32 masters, so a
restart from an older checkpoint continues from the newest published weights with that checkpoint's moments.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

CHECKPOINT_BYTES_PER_PARAM = 12
"""fp32 master weight + AdamW ``exp_avg`` + ``exp_avg_sq``, 4 bytes each."""
GB = 1e9


class CheckpointCadence:
    """Decides after each step whether to save, and whether the run's end still needs one.

    Args:
        every_steps: save when the run's step is a multiple of this (0: never by steps).
        minutes: save once this many minutes passed since the last save, or since this trainer started (0: never
            by time).
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, every_steps: int, minutes: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every, self.seconds, self.clock = every_steps, minutes * 60.0, clock
        self.since = clock()
        self.saved_step: int | None = None

    def due(self, step: int) -> bool:
        """Whether the step just taken (the run's ``step``-th) is to be saved.

        Args:
            step: the run's step count after the step.
        """
        by_steps = self.every > 0 and step % self.every == 0
        by_time = self.seconds > 0 and self.clock() - self.since >= self.seconds
        return by_steps or by_time

    def saved(self, step: int) -> None:
        """Record a save of ``step`` (the time cadence restarts from now).

        Args:
            step: the run's step count the checkpoint holds.
        """
        self.saved_step, self.since = step, self.clock()

    def final_due(self, step: int, steps_here: int) -> bool:
        """Whether the run's end needs a save: this trainer stepped and its last step is not saved yet.

        Args:
            step: the run's step count now.
            steps_here: steps this trainer took.
        """
        return steps_here > 0 and self.saved_step != step


def checkpoint_bytes(params: int) -> int:
    """Bytes of one checkpoint of a model with ``params`` parameters (without DCP's small headers).

    Args:
        params: the model's parameter count.
    """
    return CHECKPOINT_BYTES_PER_PARAM * params


def per_hour(cfg: Any, step_seconds: float) -> float:
    """Checkpoints written per hour at ``step_seconds`` per step (the run's final one aside).

    Args:
        cfg: the trainer config (``checkpoint_every``, ``checkpoint_minutes``).
        step_seconds: seconds per optimizer step.
    """
    steps_per_hour = 3600.0 / step_seconds
    by_steps = steps_per_hour / cfg.checkpoint_every if cfg.checkpoint_every else 0.0
    by_time = min(60.0 / cfg.checkpoint_minutes, steps_per_hour) if cfg.checkpoint_minutes else 0.0
    return min(steps_per_hour, by_steps + by_time)


def cadence_lines(cfg: Any, params: int | None, step_seconds: tuple[float, ...] = (10.0, 60.0)) -> list[str]:
    """The dry run's checkpoint section: bytes per checkpoint, written per hour, kept in the bucket.

    Args:
        cfg: the trainer config.
        params: the model's parameter count (None: unknown here).
        step_seconds: step times to show the hourly writes at (a step-count cadence depends on them).
    """
    when = [f"every {cfg.checkpoint_every} steps"] if cfg.checkpoint_every else []
    when += [f"every {cfg.checkpoint_minutes:g} min"] if cfg.checkpoint_minutes else []
    lines = [f"# checkpoints: {' and '.join([*when, '']) if when else 'only '}at the run's end, keep "
             f"{cfg.keep_checkpoints}" + ("" if when else " (a kill -9 loses the optimizer state since the start)")]
    if params is None:
        return [*lines, "# checkpoint size: unknown (no config.json of the model here)"]
    one = checkpoint_bytes(params)
    lines.append(f"# checkpoint size = {size(one)} ({params / 1e6:.1f}M params x {CHECKPOINT_BYTES_PER_PARAM} B: "
                 "fp32 master weights + AdamW moments)")
    lines.append("# checkpoint writes per hour = " + ", ".join(
        f"{size(one * per_hour(cfg, s))} at {s:g} s/step" for s in step_seconds))
    lines.append(f"# checkpoints kept = {size(one * cfg.keep_checkpoints)} (one more while the next one uploads)")
    return lines


def size(n: float) -> str:
    """Bytes as MB below a GB, else GB (decimal units, as buckets bill).

    Args:
        n: bytes.
    """
    return f"{n / 1e6:.1f} MB" if n < GB else f"{n / GB:.2f} GB"
