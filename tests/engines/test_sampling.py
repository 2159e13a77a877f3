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
