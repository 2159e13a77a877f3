"""The shared training batch: built once with per-row fields, filtered for local mode, split and packed."""

from __future__ import annotations

import numpy as np
import pytest

from stoa.algorithms import AlgoConfig, get_algorithm
from stoa.algorithms.batch import (
    Trajectory,
    build_batch,
    filter_and_build,
    group_indices,
    group_rows,
    micro_batches,
    pack,
)

ALGO = get_algorithm(AlgoConfig.preset("grpo"), "torch")
DAPO = get_algorithm(AlgoConfig.preset("dapo"), "torch")


def _traj(prompt: list[int], tokens: list[int], reward: float) -> Trajectory:
    return Trajectory.single_turn(prompt, tokens, [-0.5 - i for i in range(len(tokens))], reward, "stop")


def _groups() -> list[list[Trajectory]]:
    return [[_traj([1, 2, 3], [4, 5], 1.0), _traj([1, 2, 3], [6], 0.0)],
            [_traj([7, 8], [9, 10, 11], 0.5), _traj([7, 8], [12, 13], 0.5)]]


def test_build_batch_lays_out_rows_groups_and_padding():
    b = build_batch(_groups(), ALGO, version_lag=[0, 2], sources=["w-a", "w-b"])
    assert len(b) == 4 and b.width == 3
    np.testing.assert_array_equal(b.group_ids, [0, 0, 1, 1])
    np.testing.assert_array_equal(b.version_lag, [0, 0, 2, 2])
    assert b.sources == ["w-a", "w-a", "w-b", "w-b"]
    np.testing.assert_array_equal(b.mask, [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    np.testing.assert_array_equal(b.rollout_logp, [[-0.5, -1.5, 0], [-0.5, 0, 0], [-0.5, -1.5, -2.5],
                                                   [-0.5, -1.5, 0]])
    np.testing.assert_array_equal(b.rewards, [[1.0, 0.0], [0.5, 0.5]])
    expected = ALGO.advantages(np.array([[1.0, 0.0], [0.5, 0.5]]), np.array([[2, 1], [3, 2]]))
    np.testing.assert_array_equal(b.advantages, expected.reshape(-1))
    assert b.normalizer == ALGO.normalizer(b.mask)
    assert b.old_logp is None and b.ref_logp is None
    np.testing.assert_array_equal(b.seq_lengths, [5, 4, 5, 4])
    plain = build_batch(_groups(), ALGO)  # local mode: no lag, no source
    assert not plain.version_lag.any() and plain.sources == [""] * 4


def test_build_batch_refuses_uneven_groups_and_misaligned_metadata():
    groups = _groups()
    with pytest.raises(ValueError, match="groups"):
        build_batch([groups[0], groups[1][:1]], ALGO)
    with pytest.raises(ValueError, match="version_lag, sources"):
        build_batch(groups, ALGO, version_lag=[0])


def test_filter_and_build_drops_what_the_algorithm_filters():
    batch, keep = filter_and_build(_groups(), DAPO)  # group 1 has equal rewards
    assert keep.tolist() == [True, False]
    assert batch is not None and len(batch) == 2 and batch.rewards.shape == (1, 2)
    none, keep = filter_and_build([_groups()[1]], DAPO)
    assert none is None and keep.tolist() == [False]
    all_kept, keep = filter_and_build(_groups(), ALGO)
    assert all_kept is not None and keep.all() and len(all_kept) == 4


def test_micro_batches_in_row_order_or_longest_first():
    assert [m.tolist() for m in micro_batches(5, 2)] == [[0, 1], [2, 3], [4]]
    assert [m.tolist() for m in micro_batches(3, 0)] == [[0, 1, 2]]
    lengths = np.array([3, 7, 5, 7, 1])
    # longest first, ties in row order
    assert [m.tolist() for m in micro_batches(5, 2, lengths=lengths)] == [[1, 3], [2, 0], [4]]
    b = build_batch(_groups(), ALGO)
    assert [g.tolist() for g in group_indices(b)] == [[0, 1], [2, 3]]


def test_pack_and_group_rows_shapes():
    b = build_batch(_groups(), ALGO)
    b.old_logp = b.rollout_logp
    pk = pack(b, np.array([2, 1]))
    np.testing.assert_array_equal(pk.input_ids, [[7, 8, 9, 10, 11], [1, 2, 3, 6, 0]])
    np.testing.assert_array_equal(pk.attention_mask, [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    np.testing.assert_array_equal(pk.pos[0], [1, 2, 3])  # position lp - 1 + t predicts token t
    np.testing.assert_array_equal(pk.pos[1, :1], [2])
    np.testing.assert_array_equal(pk.targets, [[9, 10, 11], [6, 0, 0]])
    np.testing.assert_array_equal(pk.mask, b.mask[[2, 1]])
    np.testing.assert_array_equal(pk.advantages, b.advantages[[2, 1]])
    assert pk.old_logp is not None and pk.ref_logp is None
    np.testing.assert_array_equal(pk.old_logp, b.rollout_logp[[2, 1]])
    g = group_rows(b)[1]
    assert g.idx.tolist() == [2, 3] and g.prompt.tolist() == [7, 8]
    np.testing.assert_array_equal(g.tokens, [[9, 10, 11], [12, 13, 0]])


def test_batch_module_loads_no_backend():
    import subprocess
    import sys

    code = ("import sys, stoa.algorithms.batch, stoa.stopflag\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'mlx')]\nassert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
