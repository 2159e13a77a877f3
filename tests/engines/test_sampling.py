"""Both engines turn identical logits into the identical sampling distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stoa.engines.sampling import sampling_logprobs_np
from stoa.engines.torch import sampling_logprobs_torch


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9), (1.3, 0.5), (0.5, 0.05)])
def test_torch_matches_reference(temperature, top_p):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((16, 50)) * 3).astype(np.float32)
    ref = sampling_logprobs_np(logits, temperature, top_p)
    got = sampling_logprobs_torch(torch.from_numpy(logits), temperature, top_p).double().numpy()
    assert np.array_equal(np.isinf(ref), np.isinf(got))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(got[fin], ref[fin], atol=1e-5)
    np.testing.assert_allclose(np.exp(got).sum(-1), 1.0, atol=1e-5)


def test_top_p_keeps_crossing_token():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    lp = sampling_logprobs_np(logits, 1.0, 0.7)
    assert np.isfinite(lp[0, :2]).all() and np.isinf(lp[0, 2:]).all()
    np.testing.assert_allclose(np.exp(lp[0, :2]), [0.625, 0.375])


def test_the_nucleus_edge_allowance_covers_a_boundary_flip_and_nothing_else():
    """An honest engine whose logits differ by 1e-6 can keep a token the recompute drops when the mass before it
    sits on top_p; the allowance accepts that position alone, and a top-p-ignoring engine still fails."""
    from tests.engines.nucleus import EDGE, edge_aware_gaps

    p = np.array([0.5, 0.4, 0.06, 0.04])  # the mass before token 2 is exactly top_p = 0.9
    logits = torch.from_numpy(np.log(p)).float()[None].repeat(3, 1)
    tokens = [0, 1, 0]
    nudged = logits.clone()
    nudged[:, 1] += 3e-6  # the other engine: token 1 a hair heavier, so token 2 is dropped there
    honest = sampling_logprobs_torch(logits - torch.tensor([0.0, 3e-6, 0, 0]), 1.0, 0.9)
    recorded = honest.gather(-1, torch.tensor(tokens)[:, None])[:, 0].double().numpy()
    exact = np.abs(recorded - sampling_logprobs_torch(nudged, 1.0, 0.9).gather(
        -1, torch.tensor(tokens)[:, None])[:, 0].double().numpy())
    assert exact.max() > 1e-2  # the flip is far above the agreement tolerance
    gaps, used = edge_aware_gaps(nudged, tokens, recorded, 1.0, 0.9, 1e-4)
    assert gaps.max() <= 1e-4 and used == 3
    ignores_top_p = sampling_logprobs_torch(nudged, 1.0, 1.0).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    gaps, used = edge_aware_gaps(nudged, tokens, ignores_top_p.double().numpy(), 1.0, 0.9, 1e-4)
    assert gaps.max() > 1e-2 and used == 0
    far = torch.from_numpy(np.log(np.array([0.5, 0.3, 0.15, 0.05]))).float()[None]  # no mass near 0.9
    off = sampling_logprobs_torch(far, 1.0, 0.9 - 10 * EDGE)[0, [0]].double().numpy()
    assert edge_aware_gaps(far, [0], off, 1.0, 0.9, 1e-4)[1] == 0
