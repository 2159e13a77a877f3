"""The fused target log-softmax (``TargetLogprobs``) equals the unfused autograd chain, and scoring keeps a small
micro-batch's logits for backward (the head runs once) but checkpoints a large one's (the head runs again)."""

from __future__ import annotations

import pytest
import torch

from stoa.engines import torch_scoring
from stoa.engines.torch_scoring import TargetLogprobs


def unfused(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return torch.gather(logp, -1, targets.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_equals_the_unfused_chain_with_gradients(dtype, temperature):
    torch.manual_seed(0)
    base = (torch.randn(37, 301) * 3).to(dtype)
    targets = torch.randint(0, 301, (37,))
    upstream = torch.randn(37)
    out = {}
    for name, fn in (("fused", TargetLogprobs.apply), ("unfused", unfused)):
        x = base.clone().requires_grad_()
        lp = fn(x, targets, temperature)
        (lp * upstream).sum().backward()
        assert lp.dtype == torch.float32 and x.grad is not None and x.grad.dtype == dtype
        out[name] = (lp.detach(), x.grad)
    torch.testing.assert_close(out["fused"][0], out["unfused"][0], atol=1e-5, rtol=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the same fp32 gradient
    torch.testing.assert_close(out["fused"][1].float(), out["unfused"][1].float(), atol=tol, rtol=tol)


def test_fused_gradient_is_onehot_minus_softmax_over_the_temperature():
    logits = torch.tensor([[1.0, 2.0, 0.5]], requires_grad=True)
    TargetLogprobs.apply(logits, torch.tensor([1]), 2.0).sum().backward()
    p = torch.softmax(torch.tensor([0.5, 1.0, 0.25]), dim=0)
    assert logits.grad is not None
    torch.testing.assert_close(logits.grad[0], (torch.tensor([0.0, 1.0, 0.0]) - p) / 2.0)


def fused_with_grad(base: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, ...]:
    x = base.clone().requires_grad_()
    lp = TargetLogprobs.apply(x, targets, temperature)
    (lp * torch.linspace(-1.0, 2.0, len(lp))).sum().backward()
    assert x.grad is not None and torch.equal(x.detach(), base)  # the logits themselves untouched
    return lp.detach(), x.grad


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_cpu_row_blocks_give_the_whole_tensors_bits(monkeypatch, two_threads, dtype, temperature):
    torch.manual_seed(1)
    # 37 rows in blocks of 4 would leave a lone last row; a vocabulary past torch's grain size (32768) is what
    # torch splits across threads when a reduction has a single row
    base, targets = (torch.randn(37, 40_000) * 3).to(dtype), torch.randint(0, 40_000, (37,))
    monkeypatch.setattr(torch_scoring, "ROWS_PER_THREAD", 1 << 20)  # one block: every row at once
    whole = fused_with_grad(base, targets, temperature)
    monkeypatch.setattr(torch_scoring, "ROWS_PER_THREAD", 2)
    assert [b.stop - b.start for b in torch_scoring._row_blocks(base)] == [4] * 8 + [5]
    blocked = fused_with_grad(base, targets, temperature)
    assert torch.equal(blocked[0], whole[0]) and torch.equal(blocked[1], whole[1])


def test_cpu_takes_the_logits_in_blocks_and_other_devices_whole():
    step = torch_scoring.ROWS_PER_THREAD * torch.get_num_threads()
    sizes = [b.stop - b.start for b in torch_scoring._row_blocks(torch.empty(5000, 8))]
    assert len(sizes) > 1 and set(sizes[:-1]) == {step} and sizes[-1] >= min(step, 2) and sum(sizes) == 5000
    assert torch_scoring._row_blocks(torch.empty(5000, 8, device="meta")) == [slice(0, 5000)]
    assert torch_scoring._row_blocks(torch.empty(0, 8)) == [slice(0, 0)]


class CountingHead(torch.nn.Linear):
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CountingHead.calls += 1
        return super().forward(x)


def head_runs(monkeypatch, keep_bytes: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    monkeypatch.setattr(torch_scoring, "LOGITS_CHUNK_ELEMENTS", 4 * 50)  # 4 positions per chunk
    monkeypatch.setattr(torch_scoring, "LOGITS_KEEP_BYTES", keep_bytes)
    torch.manual_seed(0)
    head = CountingHead(8, 50, bias=False)
    hidden = torch.randn(2, 6, 8, requires_grad=True)
    targets = torch.randint(0, 50, (2, 6))
    CountingHead.calls = 0
    sc = torch_scoring._scores(head, hidden, targets, torch.ones(2, 6), 0.8, hits=False)
    sc.logp.sum().backward()
    assert hidden.grad is not None
    return CountingHead.calls, sc.logp.detach(), hidden.grad


def test_small_micro_batches_keep_their_logits_and_large_ones_recompute_them(monkeypatch):
    kept, lp_kept, g_kept = head_runs(monkeypatch, 1 << 26)
    recomputed, lp_re, g_re = head_runs(monkeypatch, 0)
    assert kept == 3  # 12 positions, 4 per chunk: the head once per chunk
    assert recomputed == 6  # and again in backward
    torch.testing.assert_close(lp_kept, lp_re)
    torch.testing.assert_close(g_kept, g_re)
