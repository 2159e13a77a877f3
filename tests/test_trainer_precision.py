"""The trainer's numerics: chunked log-softmax equals the whole-vocabulary one; bf16 compute stays close to fp32
and micro-batching still equals the whole batch in bf16 (within a stated tolerance)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stoa.algorithms import AlgoConfig, get_algorithm
from stoa.engines import torch_scoring as policy_mod
from stoa.engines.torch_scoring import pack_tensors
from stoa.trainer.policy import Policy, compute_dtype
from stoa.trainer.step import train_step
from tests.test_trainer_step import make_entries


def packed_rows(width: int = 6):
    e = make_entries(3)[0]
    comps = [s.tokens for s in e.record.samples]
    return e, pack_tensors([e.record.prompt_tokens] * len(comps), comps, width, torch.device("cpu"))


def test_chunked_log_softmax_equals_the_whole_one_with_gradients(tiny_dir, monkeypatch):
    e, batch = packed_rows()

    def run(chunk: int | None):
        if chunk:
            monkeypatch.setattr(policy_mod, "LOGITS_CHUNK_ELEMENTS", chunk)
        torch.manual_seed(0)
        pol = Policy(tiny_dir, torch.device("cpu"), temperature=0.7)
        sc = pol.score(batch, hits=True)
        (sc.logp.sum() * 1.3).backward()
        grads = {k: p.grad.clone() for k, p in pol.model.named_parameters() if p.grad is not None}
        return sc, grads

    whole, g_whole = run(None)
    chunked, g_chunked = run(300)  # 300 // the tiny vocabulary -> every position its own chunk
    torch.testing.assert_close(chunked.logp, whole.logp, atol=1e-6, rtol=1e-6)
    assert chunked.hits is not None and whole.hits is not None
    assert torch.equal(chunked.hits, whole.hits)
    assert set(g_chunked) == set(g_whole)
    scale = max(float(g.abs().max()) for g in g_whole.values())
    for k in g_whole:  # the tied head's gradient sums its chunks in another order
        torch.testing.assert_close(g_chunked[k], g_whole[k], atol=1e-5 * scale, rtol=1e-4)


def test_chunking_bounds_the_logits_alive_at_once(tiny_dir, monkeypatch):
    calls = []
    real = policy_mod._chunk_scores

    def spy(head, h, targets, temperature, hits):
        calls.append(h.shape[0])
        return real(head, h, targets, temperature, hits)

    monkeypatch.setattr(policy_mod, "_chunk_scores", spy)
    monkeypatch.setattr(policy_mod, "LOGITS_CHUNK_ELEMENTS", 3 * 512)
    _, batch = packed_rows()
    pol = Policy(tiny_dir, torch.device("cpu"))
    vocab = pol.vocab_size
    pol.score(batch).logp.sum().backward()
    per_chunk = (3 * 512) // vocab
    assert calls and max(calls) <= per_chunk and sum(calls) >= batch.targets.numel()


def test_bf16_logprobs_stay_close_to_fp32(tiny_dir):
    _, batch = packed_rows()
    fp32 = Policy(tiny_dir, torch.device("cpu")).logprobs(batch).detach()
    bf16 = Policy(tiny_dir, torch.device("cpu"), compute_dtype=torch.bfloat16).logprobs(batch).detach()
    d = (bf16 - fp32)[batch.mask > 0]
    assert float(d.abs().mean()) < 2e-2 and float(d.abs().max()) < 1e-1
    assert abs(float(torch.exp(d).mean()) - 1.0) < 2e-2  # on-policy ratios stay well inside the gate


def test_a_bf16_reference_is_stored_in_bf16_and_scores_like_the_fp32_one(tiny_dir):
    _, batch = packed_rows()
    ref = Policy(tiny_dir, torch.device("cpu"), trainable=False, compute_dtype=torch.bfloat16)
    assert {p.dtype for p in ref.model.parameters()} == {torch.bfloat16}  # half the memory of fp32 masters
    trained = Policy(tiny_dir, torch.device("cpu"), compute_dtype=torch.bfloat16)
    assert {p.dtype for p in trained.model.parameters()} == {torch.float32}  # masters stay fp32
    fp32 = Policy(tiny_dir, torch.device("cpu"), trainable=False).logprobs(batch)
    d = (ref.logprobs(batch).float() - fp32)[batch.mask > 0]
    assert float(d.abs().mean()) < 2e-2 and abs(float(torch.exp(d).mean()) - 1.0) < 2e-2


def test_micro_batches_equal_the_whole_batch_in_bf16(tiny_dir):
    def delta(micro_batch: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        pol = Policy(tiny_dir, torch.device("cpu"), compute_dtype=torch.bfloat16)
        before = {k: v.detach().clone() for k, v in pol.model.named_parameters()}
        opt = torch.optim.SGD(pol.model.parameters(), lr=1.0)
        algo = get_algorithm(AlgoConfig.from_dict({"name": "grpo", "kl_beta": 0.0}), "torch")
        train_step(pol, None, opt, algo, make_entries(), current_version=2, micro_batch=micro_batch, grad_clip=0.0)
        return {k: v.detach() - before[k] for k, v in pol.model.named_parameters()}

    whole, micro = delta(100), delta(3)
    assert max(float(v.abs().max()) for v in whole.values()) > 0
    for k in whole:  # bf16 matmuls: rows padded to other widths round differently (fp32 gives 2e-6)
        torch.testing.assert_close(micro[k], whole[k], atol=2e-3, rtol=5e-2)


@pytest.mark.parametrize(("name", "device", "want"), [("float32", "cpu", torch.float32),
                                                      ("bfloat16", "cpu", torch.bfloat16),
                                                      ("auto", "cuda", torch.bfloat16)])
def test_compute_dtype_setting(name, device, want):
    assert compute_dtype(name, torch.device(device)) == want


def test_auto_is_bf16_only_on_a_cpu_with_native_bf16(monkeypatch):
    import stoa.engines.torch as engine

    monkeypatch.setattr(engine, "cpu_has_native_bf16", lambda: False)
    assert compute_dtype("auto", torch.device("cpu")) == torch.float32
    monkeypatch.setattr(engine, "cpu_has_native_bf16", lambda: True)
    assert compute_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert np.dtype("float32")  # numpy untouched


def _linear_output_dtypes(pol: Policy) -> tuple[set[torch.dtype], list[torch.Tensor]]:
    """Hooks every Linear of the policy: the set of their output dtypes, and the head's outputs in call order."""
    dtypes: set[torch.dtype] = set()
    head_out: list[torch.Tensor] = []
    head = pol.model.get_output_embeddings()
    for m in pol.model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda mod, args, out: dtypes.add(out.dtype))
    head.register_forward_hook(lambda mod, args, out: head_out.append(out.detach()))
    return dtypes, head_out


@pytest.mark.parametrize(("dtype", "shared_prefix"), [(torch.bfloat16, False), (torch.bfloat16, True),
                                                      (torch.float32, False), (torch.float32, True)])
def test_the_policy_computes_in_its_compute_dtype(tiny_dir, dtype, shared_prefix):
    """A bf16 policy's matmuls (decoder and head) run in bf16 on its fp32 masters; an fp32 one's in fp32."""
    e, batch = packed_rows()
    pol = Policy(tiny_dir, torch.device("cpu"), compute_dtype=dtype)
    dtypes, head_out = _linear_output_dtypes(pol)
    if shared_prefix:
        comps = [s.tokens for s in e.record.samples]
        lp = pol.group_logprobs(e.record.prompt_tokens, comps, 6)
    else:
        lp = pol.logprobs(batch)
    assert dtypes == {dtype} and head_out
    assert lp.dtype == torch.float32 and {p.dtype for p in pol.model.parameters()} == {torch.float32}


def test_the_log_softmax_of_a_bf16_policy_runs_in_fp32(tiny_dir):
    """The logprobs equal an fp32 log-softmax of the bf16 head's own logits (a bf16 one is off by ~1e-2)."""
    _, batch = packed_rows()
    pol = Policy(tiny_dir, torch.device("cpu"), temperature=0.7, compute_dtype=torch.bfloat16)
    _, head_out = _linear_output_dtypes(pol)
    with torch.no_grad():
        lp = pol.logprobs(batch)
    logits = torch.cat([h.reshape(-1, h.shape[-1]) for h in head_out])
    assert logits.dtype == torch.bfloat16
    b, t = batch.targets.shape
    want = torch.log_softmax(logits.float() / 0.7, dim=-1).gather(-1, batch.targets.reshape(-1, 1)).reshape(b, t)
    torch.testing.assert_close(lp, want * batch.mask, atol=2e-6, rtol=0)


def test_token_logprobs_of_bf16_logits_are_an_fp32_log_softmax():
    """The loss's own helper upcasts before dividing by the temperature and normalising."""
    from stoa.algorithms.torch_loss import token_logprobs

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 512, generator=g) * 3).to(torch.bfloat16)
    targets = torch.randint(0, 512, (2, 5), generator=g)
    got = token_logprobs(logits, targets, 0.7)
    want = torch.log_softmax(logits.float() / 0.7, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
