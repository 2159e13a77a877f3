"""Group advantages and reward shaping in numpy (backend-free; rewards and lengths are [G, n])."""

from __future__ import annotations

import numpy as np

STD_EPS = 1e-6
"""Added to the group standard deviation (population std, ddof=0) before dividing."""


def check_groups(rewards: np.ndarray, lengths: np.ndarray | None = None) -> np.ndarray:
    """Return ``rewards`` as float64 [G, n] after checking shape and finiteness.

    Args:
        rewards: per-sample rewards, one row per prompt group.
        lengths: optional completion lengths of the same shape.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2:
        raise ValueError(f"rewards: expected [G, n], got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError("rewards: not all finite")
    if lengths is not None and np.shape(lengths) != r.shape:
        raise ValueError(f"lengths: expected shape {r.shape}, got {np.shape(lengths)}")
    return r


def overlong_shaping(rewards: np.ndarray, lengths: np.ndarray, max_tokens: int, buffer: int,
                     penalty: float) -> np.ndarray:
    """DAPO's soft overlong punishment added to the rewards.

    A completion of length L gets 0 when L <= max_tokens - buffer, then a linear ramp
    -penalty * (L - (max_tokens - buffer)) / buffer, reaching -penalty at max_tokens (and staying
    there beyond).

    Args:
        rewards: [G, n] rewards.
        lengths: [G, n] completion lengths in tokens.
        max_tokens: the completion length cap.
        buffer: the length of the punishment ramp (0 returns the rewards unchanged).
        penalty: the reward taken at max_tokens.
    """
    r = check_groups(rewards, lengths)
    if buffer <= 0:
        return r
    over = np.asarray(lengths, dtype=np.float64) - (max_tokens - buffer)
    return r - penalty * np.clip(over / buffer, 0.0, 1.0)


def group_advantages(rewards: np.ndarray, std_norm: bool) -> np.ndarray:
    """Group-relative advantages: (r - mean) / (std + STD_EPS), or r - mean without std_norm.

    Args:
        rewards: [G, n] (already shaped) rewards.
        std_norm: divide by the group's population standard deviation.
    """
    r = check_groups(rewards)
    a = r - r.mean(axis=1, keepdims=True)
    if std_norm:
        a = a / (r.std(axis=1, keepdims=True) + STD_EPS)
    return a.astype(np.float32)


def leave_one_out_advantages(rewards: np.ndarray) -> np.ndarray:
    """RLOO advantages: each reward minus the mean of the other n - 1 rewards of its group.

    Equals n / (n - 1) * (r - mean); a group of one sample gets 0.

    Args:
        rewards: [G, n] (already shaped) rewards.
    """
    r = check_groups(rewards)
    n = r.shape[1]
    if n < 2:
        return np.zeros_like(r, dtype=np.float32)
    others = (r.sum(axis=1, keepdims=True) - r) / (n - 1)
    return (r - others).astype(np.float32)


def nonzero_variance(rewards: np.ndarray) -> np.ndarray:
    """bool [G]: groups whose rewards are not all equal (DAPO's dynamic-sampling filter).

    Args:
        rewards: [G, n] raw rewards.
    """
    r = check_groups(rewards)
    return (r.max(axis=1) - r.min(axis=1)) > 0
