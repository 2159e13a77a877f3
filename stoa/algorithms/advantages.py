"""Group advantages, GiGPO's step advantages and reward shaping in numpy (backend-free; rewards are [G, n])."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

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


def discounted_turn_returns(reward: float, n_turns: int, gamma: float) -> np.ndarray:
    """Each turn's discounted return of a sparse final reward: R_t = gamma^(K-1-t) * R, float64 [K].

    Args:
        reward: the episode's (shaped) reward R, earned after the last turn.
        n_turns: K, the model turns of the episode.
        gamma: the discount (``AlgoConfig.gigpo_gamma``).
    """
    if n_turns < 0:
        raise ValueError(f"n_turns: must be >= 0, got {n_turns}")
    return float(reward) * np.power(float(gamma), np.arange(n_turns - 1, -1, -1, dtype=np.float64))


def anchor_step_advantages(returns: Sequence[np.ndarray], states: Sequence[Sequence[str]],
                           std_norm: bool) -> list[np.ndarray]:
    """GiGPO's step advantages of one prompt group: turns grouped by equal anchor-state keys.

    Every turn t of every trajectory of the group joins the anchor group of its key ``states[i][t]`` (turns
    of one trajectory may share a group when a state recurs). In an anchor group of two or more turns a
    turn's advantage is (R_t - mean) / (std + STD_EPS) (population std; R_t - mean without ``std_norm``);
    a singleton anchor gets 0, and so does the empty key (a state that is never shared).

    Args:
        returns: per trajectory, its turns' returns [K_i] (``discounted_turn_returns``).
        states: per trajectory, its turns' anchor keys (K_i of them).
        std_norm: divide by the anchor group's standard deviation.

    Returns:
        per trajectory, float64 [K_i] step advantages.
    """
    if len(returns) != len(states):
        raise ValueError(f"states: expected one sequence per trajectory ({len(returns)}), got {len(states)}")
    members: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for i, (ret, keys) in enumerate(zip(returns, states, strict=True)):
        if len(keys) != len(ret):
            raise ValueError(f"states: trajectory {i} has {len(ret)} turn returns but {len(keys)} anchor states")
        for t, key in enumerate(keys):
            if key:
                members[key].append((i, t))
    out = [np.zeros(len(r), dtype=np.float64) for r in returns]
    for turns in members.values():
        if len(turns) < 2:
            continue
        vals = np.array([returns[i][t] for i, t in turns], dtype=np.float64)
        adv = vals - vals.mean()
        if std_norm:
            adv = adv / (vals.std() + STD_EPS)
        for (i, t), a in zip(turns, adv, strict=True):
            out[i][t] = a
    return out


def gigpo_turn_advantages(rewards: np.ndarray, states: Sequence[Sequence[Sequence[str]]], gamma: float,
                          omega: float, std_norm: bool) -> list[list[np.ndarray]]:
    """omega * GiGPO step advantage of every turn of every trajectory, group by group.

    A trajectory without anchor states (single-turn) has no turns here: an empty array, i.e. nothing added.

    Args:
        rewards: [G, n] (shaped) final rewards.
        states: [G][n] anchor keys of each trajectory's turns (``Trajectory.states``).
        gamma: discount of the final reward over the turns.
        omega: weight of the step advantage.
        std_norm: normalise by the anchor group's standard deviation.
    """
    r = check_groups(rewards)
    if len(states) != r.shape[0] or any(len(g) != r.shape[1] for g in states):
        raise ValueError(f"states: expected [G={r.shape[0]}][n={r.shape[1]}] anchor-key sequences")
    out: list[list[np.ndarray]] = []
    for g, group in enumerate(states):
        returns = [discounted_turn_returns(r[g, j], len(keys), gamma) for j, keys in enumerate(group)]
        out.append([float(omega) * a for a in anchor_step_advantages(returns, group, std_norm)])
    return out
