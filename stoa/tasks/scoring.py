"""Rewards of one group, computed so that a task's reward code can fail without stopping anything.

Every place that scores completions (the trainer's re-scoring, a worker's records, evaluations, local mode)
calls :func:`score_group`. A plugin's reward code is the user's: it may raise, hang, or return something that is
not a number. Here each of those is a :class:`~stoa.tasks.base.RewardError` with a named reason, which the
trainer turns into a per-record rejection, a worker into a dropped group, an evaluation into a 0. A group is
scored in one call (a task's ``rewards(prompt, completions)`` when it has one, TRL-shaped reward functions take
the whole group) on a helper thread with a deadline; a call that hangs past it is abandoned on its thread (Python
cannot kill a thread) and reported as ``reward_timeout``.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from stoa.tasks.base import Prompt, RewardError, Task

__all__ = ["REWARD_TIMEOUT_S", "judge", "rewards_or_zeros", "score_group"]

log = logging.getLogger(__name__)

REWARD_TIMEOUT_S = 60.0
"""How long one group's rewards may take before the group is given up (``reward_timeout``)."""


def _call(task: Task, prompt: Prompt, texts: Sequence[str]) -> Any:
    batch = getattr(task, "rewards", None)
    if callable(batch):
        return batch(prompt, list(texts))
    return [task.reward(prompt, t) for t in texts]


def _checked(values: Any, n: int, task_id: str) -> list[float]:
    """``values`` as ``n`` finite floats, else ``RewardError`` naming what was wrong."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise RewardError("reward_wrong_length", f"{task_id}: rewards must be a list of {n} numbers, got "
                                                 f"{type(values).__name__}")
    if len(values) != n:
        raise RewardError("reward_wrong_length", f"{task_id}: {len(values)} rewards for {n} completions")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float):
            try:
                v = float(v)  # numpy scalars, torch 0-d tensors
            except (TypeError, ValueError):
                raise RewardError("reward_not_finite", f"{task_id}: a reward is {type(v).__name__}, not a "
                                                       "number") from None
        if not math.isfinite(v):
            raise RewardError("reward_not_finite", f"{task_id}: a reward is {v}")
        out.append(float(v))
    return out


def _guarded(task_id: str, call: Callable[[], Any], what: str, timeout_s: float) -> Any:
    """``call()`` on a helper thread with a deadline; its failure or hang is a ``RewardError``."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = call()
        except BaseException as e:  # noqa: BLE001 - the user's reward code: any failure is this group's
            result["error"] = e

    worker = threading.Thread(target=run, name=f"reward-{task_id}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise RewardError("reward_timeout", f"{task_id}: {what} took over {timeout_s:g}s")
    if "error" in result:
        e = result["error"]
        if isinstance(e, RewardError):  # the task named what failed (a dataset task: which reward function)
            raise e
        raise RewardError("reward_raised", f"{task_id}: the reward code raised {type(e).__name__}: {str(e)[:200]}")
    return result["value"]


def score_group(task: Task, prompt: Prompt, texts: Sequence[str], timeout_s: float = REWARD_TIMEOUT_S) -> list[float]:
    """The rewards of a group's completions, each a finite float.

    Args:
        task: the run's task.
        prompt: the group's prompt.
        texts: the completions (decoded; for episodes, what the policy wrote).
        timeout_s: the deadline of the whole group's scoring.

    Raises:
        RewardError: the reward code raised (``reward_raised``), hung (``reward_timeout``), returned a non-number
            or a non-finite one (``reward_not_finite``) or the wrong count (``reward_wrong_length``).
    """
    values = _guarded(task.id, lambda: _call(task, prompt, texts), f"scoring {len(texts)} completions", timeout_s)
    return _checked(values, len(texts), task.id)


def rewards_or_zeros(task: Task, prompt: Prompt, texts: Sequence[str]) -> list[float]:
    """``score_group``, or zeros with a warning when the reward code fails: for a worker's own rewards, which
    are informational (the trainer re-scores every record and rejects it with the reason if it fails there too).

    Args:
        task: the run's task.
        prompt: the group's prompt.
        texts: the completions.
    """
    try:
        return score_group(task, prompt, texts)
    except RewardError as e:
        log.warning("rewards of %s set to 0: %s", prompt.id, e)
        return [0.0] * len(texts)


def judge(task: Task, prompt: Prompt, text: str, timeout_s: float = REWARD_TIMEOUT_S) -> bool:
    """``task.is_correct(prompt, text)`` under the same guard as :func:`score_group`.

    Args:
        task: the run's task.
        prompt: the prompt.
        text: one completion.
        timeout_s: its deadline.

    Raises:
        RewardError: ``reward_raised`` or ``reward_timeout``.
    """
    return bool(_guarded(task.id, lambda: task.is_correct(prompt, text), "judging a completion", timeout_s))
