"""A bf16 compute copy of the fp32 masters (``compute_weights = "bf16_copy"``): it computes in bf16 with an fp32
log-softmax, its steps equal autocast's and fp32's within stated tolerances, it follows the masters after every
step and load, its gradients land on the masters in fp32, and checkpoints and exports are the masters' as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stoa.algorithms import AlgoConfig, get_algorithm
from stoa.bucket import open_bucket
from stoa.models.lora_torch import LoraSpec
from stoa.trainer import checkpoint as ckpt
from stoa.trainer.policy import Policy
from stoa.trainer.step import train_step
from tests.test_trainer_precision import _linear_output_dtypes, packed_rows
from tests.test_trainer_step import make_entries

CPU = torch.device("cpu")
BF16 = torch.bfloat16


def copy_policy(tiny_dir, **kw) -> Policy:
    return Policy(tiny_dir, CPU, compute_dtype=BF16, compute_weights="bf16_copy", **kw)


def rounded(pol: Policy) -> list[torch.Tensor]:
    return [p.detach().to(BF16) for p in pol.model.parameters()]


def copy_equals_masters(pol: Policy) -> bool:
    assert pol.copy is not None
    return all(torch.equal(c, m) for c, m in zip(pol.copy.copies, rounded(pol), strict=True))


def step_delta(tiny_dir, dtype: torch.dtype, weights: str, steps: int = 1) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    pol = Policy(tiny_dir, CPU, compute_dtype=dtype, compute_weights=weights)
    before = {k: v.detach().clone() for k, v in pol.model.named_parameters()}
    opt = torch.optim.SGD(pol.model.parameters(), lr=1.0)
    algo = get_algorithm(AlgoConfig.from_dict({"name": "grpo", "kl_beta": 0.0}), "torch")
    for _ in range(steps):
        train_step(pol, None, opt, algo, make_entries(), current_version=2, micro_batch=3, grad_clip=0.0)
    return {k: v.detach() - before[k] for k, v in pol.model.named_parameters()}


def test_only_an_unsharded_bf16_full_fine_tune_keeps_a_copy(tiny_dir):
    assert copy_policy(tiny_dir).copy is not None and not copy_policy(tiny_dir).autocast
    assert Policy(tiny_dir, CPU, compute_dtype=BF16).copy is None  # autocast by default
    assert Policy(tiny_dir, CPU, compute_weights="bf16_copy").copy is None  # fp32: nothing to copy
    assert copy_policy(tiny_dir, trainable=False).copy is None  # a frozen policy is stored in bf16
    assert copy_policy(tiny_dir, lora=LoraSpec(2, 4.0)).copy is None  # so is a LoRA base
    with pytest.raises(ValueError, match="use one of autocast, bf16_copy"):
        Policy(tiny_dir, CPU, compute_weights="bf16")


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_the_copy_computes_in_bf16_on_fp32_masters(tiny_dir, shared_prefix):
    e, batch = packed_rows()
    pol = copy_policy(tiny_dir)
    assert pol.copy is not None
    dtypes, head_out = _linear_output_dtypes(pol)
    copy_dtypes, copy_head = _linear_output_dtypes_of(pol.copy.module)
    if shared_prefix:
        lp = pol.group_logprobs(e.record.prompt_tokens, [s.tokens for s in e.record.samples], 6)
    else:
        lp = pol.logprobs(batch)
    assert not dtypes and not head_out  # the masters never compute
    assert copy_dtypes == {BF16} and copy_head and lp.dtype == torch.float32
    assert {p.dtype for p in pol.model.parameters()} == {torch.float32}


def _linear_output_dtypes_of(model: torch.nn.Module) -> tuple[set[torch.dtype], list[torch.Tensor]]:
    class Holder:
        pass

    h = Holder()
    h.model = model  # type: ignore[attr-defined]
    return _linear_output_dtypes(h)  # type: ignore[arg-type]


def test_the_copys_log_softmax_runs_in_fp32(tiny_dir):
    _, batch = packed_rows()
    pol = copy_policy(tiny_dir, temperature=0.7)
    assert pol.copy is not None
    _, head_out = _linear_output_dtypes_of(pol.copy.module)
    with torch.no_grad():
        lp = pol.logprobs(batch)
    logits = torch.cat([h.reshape(-1, h.shape[-1]) for h in head_out])
    assert logits.dtype == BF16
    b, t = batch.targets.shape
    want = torch.log_softmax(logits.float() / 0.7, dim=-1).gather(-1, batch.targets.reshape(-1, 1)).reshape(b, t)
    torch.testing.assert_close(lp, want * batch.mask, atol=2e-6, rtol=0)


def test_the_copys_logprobs_stay_close_to_fp32_and_equal_a_bf16_model(tiny_dir):
    """Within the autocast test's bounds of fp32 (tiny: mean 6.6e-3, max 1.7e-2 against autocast's 2.1e-3, 4.8e-3),
    and the same function as a model stored in bf16 (what a worker loads from the published weights)."""
    _, batch = packed_rows()
    fp32 = Policy(tiny_dir, CPU).logprobs(batch).detach()
    got = copy_policy(tiny_dir).logprobs(batch).detach()
    d = (got - fp32)[batch.mask > 0]
    assert float(d.abs().mean()) < 2e-2 and float(d.abs().max()) < 1e-1
    assert abs(float(torch.exp(d).mean()) - 1.0) < 2e-2
    stored = Policy(tiny_dir, CPU, trainable=False, compute_dtype=BF16)
    stored.autocast = False  # pure bf16, no autocast: a worker's forward
    torch.testing.assert_close(got, stored.logprobs(batch).detach(), atol=1e-6, rtol=0)


def test_a_copy_step_equals_autocast_and_fp32_steps_within_tolerance(tiny_dir):
    """One SGD step (lr 1, 3 micro-batches): the update is the fp32 one to 6% of its largest entry (autocast:
    4%), cosine > 0.999; measured on tiny: copy 2.6e-2, autocast 1.7e-2 of the largest entry, cosine 0.9997."""
    fp32 = step_delta(tiny_dir, torch.float32, "autocast")
    auto = step_delta(tiny_dir, BF16, "autocast")
    copy = step_delta(tiny_dir, BF16, "bf16_copy")
    scale = max(float(v.abs().max()) for v in fp32.values())
    assert scale > 0
    err = {name: max(float((d[k] - fp32[k]).abs().max()) for k in fp32) / scale
           for name, d in (("copy", copy), ("autocast", auto))}
    assert err["autocast"] < 4e-2 and err["copy"] < 6e-2, err
    cos = torch.nn.functional.cosine_similarity(torch.cat([v.flatten() for v in copy.values()]),
                                                torch.cat([v.flatten() for v in fp32.values()]), dim=0)
    assert float(cos) > 0.999


def test_the_copy_is_refreshed_after_every_step(tiny_dir):
    pol = copy_policy(tiny_dir)
    opt = torch.optim.AdamW(pol.trainable_parameters(), lr=1e-2)
    algo = get_algorithm(AlgoConfig.from_dict({"name": "grpo", "kl_beta": 0.0}), "torch")
    assert pol.copy is not None
    first = [c.detach().clone() for c in pol.copy.copies]
    for _ in range(2):
        train_step(pol, None, opt, algo, make_entries(), current_version=2, micro_batch=3, grad_clip=1.0)
        assert copy_equals_masters(pol)  # before any forward reads it
    assert any(not torch.equal(a, b) for a, b in zip(first, pol.copy.copies, strict=True))


def test_a_load_reaches_the_copy_before_the_next_forward(tiny_dir):
    _, batch = packed_rows()
    pol = copy_policy(tiny_dir)
    arrays = {k: (v * 1.5).astype(np.float32) for k, v in pol.export_f32().items()}
    pol.load_f32(arrays)
    want = copy_policy(tiny_dir)
    want.load_f32(arrays)
    torch.testing.assert_close(pol.logprobs(batch), want.logprobs(batch), atol=0, rtol=0)
    assert copy_equals_masters(pol)


def test_gradients_accumulate_on_the_fp32_masters(tiny_dir):
    _, batch = packed_rows()
    pol = copy_policy(tiny_dir)
    assert pol.copy is not None
    pol.logprobs(batch).sum().backward()
    once = {k: p.grad.clone() for k, p in pol.model.named_parameters() if p.grad is not None}
    assert set(once) == set(dict(pol.model.named_parameters()))
    assert {g.dtype for g in once.values()} == {torch.float32}
    assert all(c.grad is None for c in pol.copy.copies)  # the bf16 gradients are freed as they land
    pol.logprobs(batch).sum().backward()  # a second micro-batch adds in fp32
    for k, p in pol.model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[k], atol=0, rtol=0)
    auto = Policy(tiny_dir, CPU, compute_dtype=BF16)
    auto.logprobs(batch).sum().backward()
    for k, p in auto.model.named_parameters():
        assert p.grad is not None
        scale = float(p.grad.abs().max()) + 1e-6
        assert float((once[k] - p.grad).abs().max()) < 0.15 * scale, k


def test_checkpoints_and_exports_hold_the_fp32_masters(tiny_dir, tmp_path):
    pol, auto = copy_policy(tiny_dir), Policy(tiny_dir, CPU, compute_dtype=BF16)
    for p in (pol, auto):
        with torch.no_grad():
            for t in p.model.parameters():
                t.add_(1e-4)  # off the bf16 grid: an export of the copy would differ
    _, batch = packed_rows()
    pol.logprobs(batch)  # the copy follows the masters (and never the reverse)
    exp, exp_auto = pol.export_f32(), auto.export_f32()
    assert list(exp) == list(exp_auto)
    for k in exp:
        assert exp[k].dtype == np.float32 and np.array_equal(exp[k], exp_auto[k])
    bucket = open_bucket(str(tmp_path / "b"))
    saved = {}
    for name, p in (("copy", pol), ("auto", auto)):
        opt = torch.optim.AdamW(p.trainable_parameters(), lr=1e-3)
        ckpt.save_checkpoint(bucket, name, p.model, opt, version=1, step=1, echo=lambda *_: None)
        got = ckpt.checkpoint_params(bucket, name)
        assert got is not None
        saved[name] = got[1]
    assert list(saved["copy"]) == list(saved["auto"])
    for k, v in saved["copy"].items():
        assert torch.equal(v, saved["auto"][k])


def test_the_trainer_samples_from_the_copy_holding_the_current_weights(tiny_dir):
    """Cold-start rft and held-out evals sample the function the steps train: the copy, after the masters moved."""
    from stoa.trainer.coldstart import sampling_engine

    pol = copy_policy(tiny_dir)
    with torch.no_grad():
        for p in pol.model.parameters():
            p.add_(0.05)
    with sampling_engine(pol, False, pol.export_f32, None, "bfloat16") as engine:
        assert pol.copy is not None and engine.model is pol.copy.module and copy_equals_masters(pol)
