"""Splitting a step's groups across ranks: by tokens, the same on every rank, every rank running as many
micro-batches (pure functions, no process group)."""

from __future__ import annotations

import numpy as np

from stoa.trainer.dist import Dist, split_groups


def test_groups_go_to_ranks_by_tokens_not_by_count():
    # One long group and three short ones: by count rank 0 would take two; by tokens the long one is alone.
    assert split_groups([100, 10, 10, 10], 2) == [[0], [1, 2, 3]]
    assert split_groups([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]
    # Fewer groups than ranks: the last ranks get nothing (they still join the collectives).
    assert split_groups([7], 3) == [[0], [], []]
    shares = split_groups(list(range(1, 20)), 4)
    assert sorted(g for s in shares for g in s) == list(range(19))  # every group exactly once


def test_every_rank_runs_the_same_number_of_micro_batches():
    from stoa.algorithms import AlgoConfig, get_algorithm
    from stoa.trainer.step import entries_batch, rank_micro_batches
    from tests.dist.step_main import entries

    algo = get_algorithm(AlgoConfig.from_dict({"name": "grpo"}), "torch")
    batch = entries_batch(entries(0), algo, 1)
    for shared in (False, True):
        alone, pad = rank_micro_batches(batch, Dist(), 3, shared)
        assert pad == 0 and sorted(np.concatenate(alone).tolist()) == list(range(len(batch)))
        parts = [rank_micro_batches(batch, Dist(rank=r, world_size=4), 3, shared) for r in range(4)]
        rows = np.concatenate([m for micro, _ in parts for m in micro])
        assert sorted(rows.tolist()) == list(range(len(batch)))  # each row on exactly one rank
        assert len({len(micro) + pad for micro, pad in parts}) == 1  # padded to the same count
