"""Backend-free training batches: trajectories with action masks, advantages, micro-batches and packing (numpy)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stoa.algorithms import Algorithm


@dataclass
class Trajectory:
    """One sampled trajectory: a prompt, then every token after it.

    Single-turn, ``tokens`` is the completion and ``action_mask`` is all ones. Multi-turn, ``tokens`` holds
    the policy's turns and the environment's observations in order, and ``action_mask`` is 1 only on the
    tokens the policy sampled: the loss, the normaliser and the logprob ratios see only those, through the
    ``mask`` of ``LossInputs``, with no per-algorithm branch.

    Attributes:
        prompt: prompt token ids (the shared prefix of its group).
        tokens: token ids after the prompt.
        action_mask: float32, 1 where the policy sampled the token (trained on), 0 elsewhere.
        reward: the trajectory's reward.
        finish_reason: 'stop' or 'length' (the last turn's).
        rollout_logprobs: decode-time logprobs per token (0 off the action mask); diagnostics only, the
            loss uses full-forward logprobs (see docs/local.md).
    """

    prompt: np.ndarray
    tokens: np.ndarray
    action_mask: np.ndarray
    reward: float
    finish_reason: str
    rollout_logprobs: np.ndarray

    @classmethod
    def single_turn(cls, prompt: Sequence[int], tokens: Sequence[int], logprobs: Sequence[float], reward: float,
                    finish_reason: str) -> Trajectory:
        """A completion of one turn: every token is an action.

        Args:
            prompt: prompt token ids.
            tokens: completion token ids (non-empty).
            logprobs: decode-time logprobs of ``tokens``.
            reward: the task's reward.
            finish_reason: 'stop' or 'length'.
        """
        toks = np.asarray(tokens, dtype=np.int64)
        return cls(np.asarray(prompt, dtype=np.int64), toks, np.ones(len(toks), np.float32), float(reward),
                   finish_reason, np.asarray(logprobs, dtype=np.float32))

    def __post_init__(self) -> None:
        if len(self.tokens) == 0:
            raise ValueError("tokens: a trajectory needs at least one token after the prompt")
        if len(self.prompt) == 0:
            raise ValueError("prompt: a trajectory needs at least one prompt token")
        if self.action_mask.shape != self.tokens.shape:
            raise ValueError(f"action_mask: shape {self.action_mask.shape} != tokens {self.tokens.shape}")


@dataclass
class Batch:
    """The rows of one optimizer step (groups contiguous) with everything the loss needs.

    Attributes:
        rows: the trajectories, group by group.
        group_ids: [B] index of each row's group.
        advantages: [B] float32 per-row advantages.
        mask: [B, T] float32 action mask padded to the longest row (T = ``width``).
        normalizer: the algorithm's whole-batch loss denominator (identical for every micro-batch).
        rewards: [G, n] raw rewards of the kept groups.
        old_logp: [B, T] old-policy logprobs from a full forward (set by the loop).
        ref_logp: [B, T] reference logprobs (adapters disabled), or None when kl_beta is 0.
    """

    rows: list[Trajectory]
    group_ids: np.ndarray
    advantages: np.ndarray
    mask: np.ndarray
    normalizer: float
    rewards: np.ndarray
    old_logp: np.ndarray | None = None
    ref_logp: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        """T: the padded length of the token axis."""
        return int(self.mask.shape[1])


@dataclass
class Packed:
    """A micro-batch as right-padded (prompt + tokens) rows and gather indices, all numpy.

    ``pos[b, t]`` is the position whose output predicts token ``t`` after the prompt of row ``b``.
    Right padding needs no attention mask: causal attention never looks forward.
    """

    input_ids: np.ndarray  # [b, L] int32
    pos: np.ndarray  # [b, T] int32
    targets: np.ndarray  # [b, T] int32
    mask: np.ndarray  # [b, T] float32 (action mask)
    advantages: np.ndarray  # [b] float32
    old_logp: np.ndarray | None  # [b, T] float32
    ref_logp: np.ndarray | None  # [b, T] float32


def build_batch(groups: Sequence[Sequence[Trajectory]], algo: Algorithm) -> tuple[Batch | None, np.ndarray]:
    """Advantages, the algorithm's group filter and the whole-batch normaliser.

    Args:
        groups: one list of trajectories per prompt (equal sizes).
        algo: the algorithm (any backend: only its numpy side is used).

    Returns:
        (the batch, or None when the filter dropped every group; bool [G] of kept groups).
    """
    if not groups or len({len(g) for g in groups}) != 1:
        raise ValueError("groups: need at least one group, all of the same size")
    rewards = np.array([[t.reward for t in g] for g in groups], dtype=np.float64)
    lengths = np.array([[int(t.action_mask.sum()) for t in g] for g in groups], dtype=np.int64)
    keep = np.asarray(algo.keep_groups(rewards), dtype=bool)
    if not keep.any():
        return None, keep
    adv = np.asarray(algo.advantages(rewards[keep], lengths[keep]), dtype=np.float32)
    rows, gids, advs = [], [], []
    for gi, gidx in enumerate(np.flatnonzero(keep)):
        for si, t in enumerate(groups[int(gidx)]):
            rows.append(t)
            gids.append(gi)
            advs.append(adv[gi, si])
    width = max(len(t.tokens) for t in rows)
    mask = np.zeros((len(rows), width), dtype=np.float32)
    for i, t in enumerate(rows):
        mask[i, : len(t.tokens)] = t.action_mask
    batch = Batch(rows, np.array(gids, dtype=np.int64), np.array(advs, dtype=np.float32), mask,
                  float(algo.normalizer(mask)), rewards[keep].astype(np.float32))
    return batch, keep


def micro_batches(n_rows: int, micro_batch: int) -> list[np.ndarray]:
    """Row indices of each micro-batch: consecutive chunks of ``micro_batch`` rows (0 = one chunk).

    Args:
        n_rows: rows in the batch.
        micro_batch: rows per chunk, 0 for all at once.
    """
    size = n_rows if micro_batch <= 0 else micro_batch
    return [np.arange(i, min(i + size, n_rows)) for i in range(0, n_rows, size)]


def group_rows(batch: Batch) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per group: (row indices, the shared prompt, the rows' tokens right-padded to ``batch.width``).

    Args:
        batch: the step's batch (a group's rows share their prompt).
    """
    out = []
    for g in np.unique(batch.group_ids):
        idx = np.flatnonzero(batch.group_ids == g)
        tokens = np.zeros((len(idx), batch.width), dtype=np.int32)
        for j, i in enumerate(idx):
            tokens[j, : len(batch.rows[int(i)].tokens)] = batch.rows[int(i)].tokens
        out.append((idx, batch.rows[int(idx[0])].prompt, tokens))
    return out


def pack(batch: Batch, idx: np.ndarray) -> Packed:
    """Right-pad the rows ``idx`` of a batch into arrays for one forward.

    Args:
        batch: the step's batch.
        idx: row indices of the micro-batch.
    """
    rows = [batch.rows[int(i)] for i in idx]
    width_t = batch.width
    length = max(len(r.prompt) + len(r.tokens) for r in rows)
    ids = np.zeros((len(rows), length), dtype=np.int32)
    pos = np.zeros((len(rows), width_t), dtype=np.int32)
    tgt = np.zeros((len(rows), width_t), dtype=np.int32)
    for j, r in enumerate(rows):
        lp, lt = len(r.prompt), len(r.tokens)
        ids[j, :lp] = r.prompt
        ids[j, lp : lp + lt] = r.tokens
        pos[j, :lt] = np.arange(lp - 1, lp + lt - 1)
        pos[j, lt:] = lp - 1  # padding: any valid position will do, the mask drops it
        tgt[j, :lt] = r.tokens
    old = None if batch.old_logp is None else batch.old_logp[idx]
    ref = None if batch.ref_logp is None else batch.ref_logp[idx]
    return Packed(ids, pos, tgt, batch.mask[idx], batch.advantages[idx], old, ref)
