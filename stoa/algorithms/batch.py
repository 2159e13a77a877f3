"""The training batch of one optimizer step, shared by the trainer and local mode (numpy only).

A step trains on groups of trajectories (one prompt, n samples each). ``build_batch`` turns them into a
``Batch`` once: per-row advantages, the padded action mask, the algorithm's whole-batch normaliser, the
sampler's logprobs, and where each group came from. ``micro_batches`` and ``group_indices`` split it into
micro-batches (length-sorted or consecutive chunks; one group each for a shared-prefix forward), and
``pack`` right-pads a micro-batch into the arrays of one forward (``pack_rows``: any rows, for a forward that
only scores). Backends (torch in the trainer, torch or MLX in local mode) only turn these arrays into tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from stoa.algorithms.base import Algorithm
from stoa.envs.base import action_runs
from stoa.rollouts.episode import ROLE_ACTION, ROLE_ECHO, ROLES


def _empty_f32() -> np.ndarray:
    return np.zeros(0, dtype=np.float32)


@dataclass
class Trajectory:
    """One sampled trajectory: a prompt, then every token after it.

    Single-turn, ``tokens`` is the completion and ``action_mask`` is all ones. Multi-turn, ``tokens`` holds
    the policy's turns and the environment's observations in order, and ``action_mask`` is 1 only on the
    tokens the policy sampled: the loss, the normaliser and the logprob ratios see only those, through the
    ``mask`` of ``LossInputs``, with no per-algorithm branch. ``echo_mask`` marks the observation tokens the
    ECHO term learns to predict; ``turn_of_token`` and ``states`` give GiGPO its turns and anchor states.

    Attributes:
        prompt: prompt token ids (the shared prefix of its group).
        tokens: token ids after the prompt.
        action_mask: float32, 1 where the policy sampled the token (trained on), 0 elsewhere.
        reward: the trajectory's reward.
        finish_reason: 'stop' or 'length' (the last turn's).
        rollout_logprobs: the sampler's logprobs per token (0 off the action mask). The trainer's old
            policy (a worker's recorded logprobs); in local mode diagnostics only, its loss uses
            full-forward logprobs (see docs/local.md).
        echo_mask: float32 [T], 1 on echo tokens (``ROLE_ECHO``); zeros by default.
        turn_of_token: int32 [T], the model turn of each action token and -1 elsewhere; None single-turn.
        states: the anchor-state key at the start of each model turn (``Episode.states``); () single-turn.
    """

    prompt: np.ndarray
    tokens: np.ndarray
    action_mask: np.ndarray
    reward: float
    finish_reason: str
    rollout_logprobs: np.ndarray
    echo_mask: np.ndarray = field(default_factory=_empty_f32)
    turn_of_token: np.ndarray | None = None
    states: tuple[str, ...] = ()

    @classmethod
    def single_turn(cls, prompt: Sequence[int] | np.ndarray, tokens: Sequence[int] | np.ndarray,
                    logprobs: Sequence[float] | np.ndarray, reward: float, finish_reason: str) -> Trajectory:
        """A completion of one turn: every token is an action.

        Args:
            prompt: prompt token ids.
            tokens: completion token ids (non-empty).
            logprobs: the sampler's logprobs of ``tokens``.
            reward: the task's reward.
            finish_reason: 'stop' or 'length'.
        """
        toks = np.asarray(tokens, dtype=np.int64)
        return cls(np.asarray(prompt, dtype=np.int64), toks, np.ones(len(toks), np.float32), float(reward),
                   finish_reason, np.asarray(logprobs, dtype=np.float32))

    @classmethod
    def multi_turn(cls, prompt: Sequence[int] | np.ndarray, tokens: Sequence[int] | np.ndarray,
                   roles: Sequence[int] | np.ndarray, logprobs: Sequence[float] | np.ndarray, reward: float,
                   finish_reason: str, turn_of_token: Sequence[int] | np.ndarray | None = None,
                   states: Sequence[str] = ()) -> Trajectory:
        """An episode: actions (``ROLE_ACTION``) and observations (``ROLE_MASKED`` / ``ROLE_ECHO``) in order.

        The action mask is ``roles == ROLE_ACTION`` and the echo mask ``roles == ROLE_ECHO``; the logprobs
        off the action tokens are dropped (set to 0), so nothing downstream can read them.

        Args:
            prompt: prompt token ids.
            tokens: every token id after the prompt.
            roles: the ``ROLE_*`` of each token.
            logprobs: the sampler's logprobs per token (read on action tokens only).
            reward: the task's reward of the episode.
            finish_reason: 'stop' or 'length'.
            turn_of_token: model turn of each action token, -1 elsewhere (``Replayed.turn_of_token``); None:
                the turns are the maximal runs of action tokens.
            states: anchor-state key at the start of each turn (``Replayed.states``), or () for none.
        """
        toks = np.asarray(tokens, dtype=np.int64)
        r = np.asarray(roles, dtype=np.int64)
        lp = np.asarray(logprobs, dtype=np.float32)
        if r.shape != toks.shape or lp.shape != toks.shape:
            raise ValueError(f"roles, logprobs: shapes {r.shape}, {lp.shape} != tokens {toks.shape}")
        if not np.isin(r, ROLES).all():
            raise ValueError(f"roles: every role must be one of {ROLES}, got {sorted(set(r.tolist()))}")
        action = r == ROLE_ACTION
        if not action.any():
            raise ValueError("roles: a multi-turn trajectory needs at least one action token")
        if turn_of_token is None:
            turns = np.full(len(toks), -1, dtype=np.int32)
            for k, (a, b) in enumerate(action_runs(r.tolist())):
                turns[a:b] = k
        else:
            turns = np.asarray(turn_of_token, dtype=np.int32)
        return cls(np.asarray(prompt, dtype=np.int64), toks, action.astype(np.float32), float(reward),
                   finish_reason, np.where(action, lp, 0.0).astype(np.float32), (r == ROLE_ECHO).astype(np.float32),
                   turns, tuple(str(k) for k in states))

    def __post_init__(self) -> None:
        if len(self.tokens) == 0:
            raise ValueError("tokens: a trajectory needs at least one token after the prompt")
        if len(self.prompt) == 0:
            raise ValueError("prompt: a trajectory needs at least one prompt token")
        if self.action_mask.shape != self.tokens.shape:
            raise ValueError(f"action_mask: shape {self.action_mask.shape} != tokens {self.tokens.shape}")
        if self.echo_mask.size == 0:
            self.echo_mask = np.zeros(self.tokens.shape, dtype=np.float32)
        if self.echo_mask.shape != self.tokens.shape:
            raise ValueError(f"echo_mask: shape {self.echo_mask.shape} != tokens {self.tokens.shape}")
        if np.any((self.echo_mask > 0) & (self.action_mask > 0)):
            raise ValueError("echo_mask: a token cannot be both an action and an echo token")
        self._check_turns()

    def _check_turns(self) -> None:
        """turn_of_token: -1 exactly off the actions, non-decreasing turns from 0, one state per turn."""
        if self.turn_of_token is None:
            if self.states:
                raise ValueError("turn_of_token: needed with states (which tokens belong to which turn)")
            return
        turns = self.turn_of_token
        if turns.shape != self.tokens.shape:
            raise ValueError(f"turn_of_token: shape {turns.shape} != tokens {self.tokens.shape}")
        action = self.action_mask > 0
        if np.any(turns[~action] != -1) or np.any(turns[action] < 0):
            raise ValueError("turn_of_token: must be >= 0 on action tokens and -1 on every other token")
        on = turns[action]
        if on.size and (on[0] != 0 or np.any(np.diff(on) < 0)):
            raise ValueError("turn_of_token: turns must start at 0 and never decrease")
        n_turns = int(on.max()) + 1 if on.size else 0
        if self.states and len(self.states) != n_turns:
            raise ValueError(f"states: {len(self.states)} anchor states for {n_turns} turns; need one per turn")


@dataclass
class Batch:
    """The rows of one optimizer step (groups contiguous, equal sizes) with everything the loss needs.

    B is the number of rows, G of groups, n rows per group, T the longest row's tokens after its prompt.

    Attributes:
        rows: the trajectories, group by group.
        group_ids: [B] int64 index of each row's group.
        advantages: [B] float32 per-row advantages.
        version_lag: [B] int64 trainer version minus the version that sampled the row (0 in local mode).
        sources: [B] who sampled each row: the worker id in the trainer, '' in local mode.
        mask: [B, T] float32 action mask, 0-padded.
        rollout_logp: [B, T] float32 the sampler's logprobs (``Trajectory.rollout_logprobs``), 0-padded.
        normalizer: the algorithm's whole-batch loss denominator (identical for every micro-batch).
        rewards: [G, n] float32 rewards of the groups.
        old_logp: [B, T] the old policy of the ratio, or None: the trainer sets ``rollout_logp``; local mode
            a full forward, or None to take it from the update's own forward.
        ref_logp: [B, T] reference logprobs, or None when kl_beta is 0.
        echo_mask: [B, T] float32 echo-token mask, 0-padded (zeros without echo tokens).
        echo_normalizer: the whole batch's echo-token count, at least 1 (``LossInputs.echo_normalizer``).
        token_advantages: [B, T] float32 per-token advantages when the algorithm makes them (GiGPO: the row's
            advantage plus its turn's step term on action tokens, the row's advantage elsewhere), else None.
    """

    rows: list[Trajectory]
    group_ids: np.ndarray
    advantages: np.ndarray
    version_lag: np.ndarray
    sources: list[str]
    mask: np.ndarray
    rollout_logp: np.ndarray
    normalizer: float
    rewards: np.ndarray
    old_logp: np.ndarray | None = None
    ref_logp: np.ndarray | None = None
    echo_mask: np.ndarray = field(default_factory=_empty_f32)
    echo_normalizer: float = 1.0
    token_advantages: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.echo_mask.size == 0:
            self.echo_mask = np.zeros_like(self.mask, dtype=np.float32)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        """T: the padded length of the token axis."""
        return int(self.mask.shape[1])

    @property
    def seq_lengths(self) -> np.ndarray:
        """[B] int64 prompt + tokens of each row (what a packed forward runs)."""
        return np.array([len(r.prompt) + len(r.tokens) for r in self.rows], dtype=np.int64)


@dataclass
class Packed:
    """A micro-batch as right-padded (prompt + tokens) rows and gather indices, all numpy.

    ``pos[b, t]`` is the position whose output predicts token ``t`` after the prompt of row ``b``.
    Right padding needs no attention mask (causal attention never looks forward); ``attention_mask`` is
    there for forwards that take one anyway.
    """

    input_ids: np.ndarray  # [b, L] int32
    attention_mask: np.ndarray  # [b, L] int32, 1 on prompt and tokens
    pos: np.ndarray  # [b, T] int32
    targets: np.ndarray  # [b, T] int32
    mask: np.ndarray  # [b, T] float32 (action mask)
    advantages: np.ndarray  # [b] float32
    old_logp: np.ndarray | None  # [b, T] float32
    ref_logp: np.ndarray | None  # [b, T] float32
    echo_mask: np.ndarray | None = None  # [b, T] float32
    token_advantages: np.ndarray | None = None  # [b, T] float32, or None: per-row advantages


class GroupRows(NamedTuple):
    """One group of a batch for a shared-prefix forward."""

    idx: np.ndarray  # [n] row indices
    prompt: np.ndarray  # the group's shared prompt
    tokens: np.ndarray  # [n, T] int32 the rows' tokens, right-padded to the batch width


def build_batch(groups: Sequence[Sequence[Trajectory]], algo: Algorithm, *,
                version_lag: Sequence[int] | None = None, sources: Sequence[str] | None = None) -> Batch:
    """Advantages, the padded masks and sampler logprobs, and the whole-batch normalisers of every group given.

    Args:
        groups: one list of trajectories per prompt (equal sizes), already through the algorithm's group
            filter (see ``filter_and_build``).
        algo: the algorithm (any backend: only its numpy side is used).
        version_lag: per group, the trainer version minus the version that sampled it (default 0).
        sources: per group, who sampled it (default '').
    """
    if not groups or len({len(g) for g in groups}) != 1:
        raise ValueError("groups: need at least one group, all of the same size")
    n_groups, n = len(groups), len(groups[0])
    rewards = np.array([[t.reward for t in g] for g in groups], dtype=np.float64)
    lengths = np.array([[int(t.action_mask.sum()) for t in g] for g in groups], dtype=np.int64)
    adv = np.asarray(algo.advantages(rewards, lengths), dtype=np.float32).reshape(-1)
    turn_adv = algo.turn_advantages(rewards, lengths, [[t.states for t in g] for g in groups])
    rows = [t for g in groups for t in g]
    width = max(len(t.tokens) for t in rows)
    mask = np.zeros((len(rows), width), dtype=np.float32)
    echo = np.zeros((len(rows), width), dtype=np.float32)
    rollout_logp = np.zeros((len(rows), width), dtype=np.float32)
    for i, t in enumerate(rows):
        mask[i, : len(t.tokens)] = t.action_mask
        echo[i, : len(t.tokens)] = t.echo_mask
        rollout_logp[i, : len(t.tokens)] = t.rollout_logprobs
    lag = np.zeros(n_groups, np.int64) if version_lag is None else np.asarray(version_lag, np.int64)
    src = [""] * n_groups if sources is None else list(sources)
    if len(lag) != n_groups or len(src) != n_groups:
        raise ValueError(f"version_lag, sources: need one per group ({n_groups})")
    token_adv = None if turn_adv is None else token_advantages(rows, adv, [a for g in turn_adv for a in g], width)
    return Batch(rows, np.repeat(np.arange(n_groups, dtype=np.int64), n), adv, np.repeat(lag, n),
                 [s for s in src for _ in range(n)], mask, rollout_logp, float(algo.normalizer(mask)),
                 rewards.astype(np.float32), echo_mask=echo, echo_normalizer=max(1.0, float(echo.sum())),
                 token_advantages=token_adv)


def token_advantages(rows: Sequence[Trajectory], advantages: np.ndarray, turn_adv: Sequence[np.ndarray],
                     width: int) -> np.ndarray:
    """[B, width] float32: each row's advantage, plus on its action tokens their turn's term.

    Args:
        rows: the trajectories.
        advantages: [B] per-row (episode) advantages.
        turn_adv: per row, what each of its turns adds ([K]; empty for a row without turns).
        width: the batch's padded token width.
    """
    if len(turn_adv) != len(rows):
        raise ValueError(f"turn_adv: expected one array per row ({len(rows)}), got {len(turn_adv)}")
    out = np.repeat(np.asarray(advantages, np.float64)[:, None], width, axis=1)
    for i, (t, add) in enumerate(zip(rows, turn_adv, strict=True)):
        if len(add) == 0 or t.turn_of_token is None:
            continue
        on = np.flatnonzero(t.turn_of_token >= 0)
        out[i, on] += np.asarray(add, np.float64)[t.turn_of_token[on]]
    return out.astype(np.float32)


def filter_and_build(groups: Sequence[Sequence[Trajectory]], algo: Algorithm
                     ) -> tuple[Batch | None, np.ndarray]:
    """The algorithm's group filter (DAPO drops zero-variance groups), then ``build_batch`` on what it keeps.

    Local mode filters here; the trainer filters at intake (``RecordPool.take``) and calls ``build_batch``.

    Args:
        groups: one list of trajectories per prompt (equal sizes).
        algo: the algorithm.

    Returns:
        (the batch, or None when the filter dropped every group; bool [G] of kept groups).
    """
    if not groups or len({len(g) for g in groups}) != 1:
        raise ValueError("groups: need at least one group, all of the same size")
    rewards = np.array([[t.reward for t in g] for g in groups], dtype=np.float64)
    keep = np.asarray(algo.keep_groups(rewards), dtype=bool)
    if not keep.any():
        return None, keep
    return build_batch([g for g, k in zip(groups, keep, strict=True) if k], algo), keep


def micro_batches(n_rows: int, micro_batch: int, *, lengths: np.ndarray | None = None) -> list[np.ndarray]:
    """Row indices of each micro-batch: chunks of ``micro_batch`` rows (0 = one chunk).

    Args:
        n_rows: rows in the batch.
        micro_batch: rows per chunk, 0 for all at once.
        lengths: [n_rows] sequence lengths (``Batch.seq_lengths``): rows go longest first (ties in row order)
            so each chunk pads little; None keeps row order.
    """
    order = np.arange(n_rows) if lengths is None else np.argsort(-np.asarray(lengths), kind="stable")
    size = n_rows if micro_batch <= 0 else micro_batch
    return [order[i : i + size] for i in range(0, n_rows, size)]


def group_indices(batch: Batch) -> list[np.ndarray]:
    """Row indices of each group, in group order (one micro-batch each for a shared-prefix forward).

    Args:
        batch: the step's batch.
    """
    return [np.flatnonzero(batch.group_ids == g) for g in np.unique(batch.group_ids)]


def group_rows(batch: Batch) -> list[GroupRows]:
    """Per group: its row indices, the shared prompt, and the rows' tokens right-padded to ``batch.width``.

    Args:
        batch: the step's batch (a group's rows share their prompt).
    """
    out = []
    for idx in group_indices(batch):
        tokens = np.zeros((len(idx), batch.width), dtype=np.int32)
        for j, i in enumerate(idx):
            tokens[j, : len(batch.rows[int(i)].tokens)] = batch.rows[int(i)].tokens
        out.append(GroupRows(idx, batch.rows[int(idx[0])].prompt, tokens))
    return out


def pack_rows(prompts: Sequence[np.ndarray], tokens: Sequence[np.ndarray], width: int) -> Packed:
    """Right-pad prompt + tokens rows into the arrays of one forward, scoring every token after the prompt (no
    advantages, no old or reference logprobs: a forward that only scores).

    Args:
        prompts: prompt token ids per row.
        tokens: token ids after the prompt per row (non-empty).
        width: T, the width of the token axis (>= the longest row's tokens).
    """
    length = max(len(p) + len(t) for p, t in zip(prompts, tokens, strict=True))
    ids = np.zeros((len(prompts), length), dtype=np.int32)
    attn = np.zeros((len(prompts), length), dtype=np.int32)
    pos = np.zeros((len(prompts), width), dtype=np.int32)
    tgt = np.zeros((len(prompts), width), dtype=np.int32)
    mask = np.zeros((len(prompts), width), dtype=np.float32)
    for j, (p, t) in enumerate(zip(prompts, tokens, strict=True)):
        lp, lt = len(p), len(t)
        ids[j, :lp] = p
        ids[j, lp : lp + lt] = t
        attn[j, : lp + lt] = 1
        pos[j, :lt] = np.arange(lp - 1, lp + lt - 1)
        pos[j, lt:] = lp - 1  # padding: any valid position will do, the mask drops it
        tgt[j, :lt] = t
        mask[j, :lt] = 1.0
    return Packed(ids, attn, pos, tgt, mask, np.zeros(len(prompts), np.float32), None, None)


def pack(batch: Batch, idx: np.ndarray) -> Packed:
    """Right-pad the rows ``idx`` of a batch into arrays for one forward (``pack_rows``), with their action mask,
    advantages and the batch's logprobs.

    Args:
        batch: the step's batch.
        idx: row indices of the micro-batch.
    """
    rows = [batch.rows[int(i)] for i in idx]
    pk = pack_rows([r.prompt for r in rows], [r.tokens for r in rows], batch.width)
    old = None if batch.old_logp is None else batch.old_logp[idx]
    ref = None if batch.ref_logp is None else batch.ref_logp[idx]
    tok_adv = None if batch.token_advantages is None else batch.token_advantages[idx]
    return Packed(pk.input_ids, pk.attention_mask, pk.pos, pk.targets, batch.mask[idx], batch.advantages[idx], old,
                  ref, batch.echo_mask[idx], tok_adv)
