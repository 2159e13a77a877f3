"""The trainer's AdamW kernel: fused on one CUDA device (faster there), torch's default on CPU and under FSDP2."""

from __future__ import annotations

import torch

from stoa.trainer.ranks import adamw_fused


def test_one_cuda_device_gets_the_fused_kernel_and_nothing_else_does():
    assert adamw_fused(torch.device("cuda", 0), sharded=False) is True
    assert adamw_fused(torch.device("cuda", 0), sharded=True) is None
    assert adamw_fused(torch.device("cpu"), sharded=False) is None


def test_the_kwargs_build_an_optimizer():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, fused=adamw_fused(torch.device("cpu"), sharded=False))
    p.grad = torch.ones(3)
    opt.step()
    assert torch.all(p < 1.0)
