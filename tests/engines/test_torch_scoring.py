"""The one torch scoring path (``stoa.engines.torch_scoring``): the packed tensors it scores, the shared-prefix
forward equal to the packed one, and local mode's torch backend scoring through it exactly as the trainer does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stoa.algorithms import AlgoConfig, get_algorithm
from stoa.algorithms.batch import Trajectory, build_batch, pack, pack_rows
from stoa.engines.torch_scoring import group_score, pack_tensors, score, to_device

CPU = torch.device("cpu")
PROMPTS = [np.array([1, 2, 3]), np.array([4])]
TOKENS = [np.array([5, 6]), np.array([7, 8, 9])]


def test_pack_rows_pads_and_points_at_the_predicting_positions():
    pk = pack_rows(PROMPTS, TOKENS, 4)
    np.testing.assert_array_equal(pk.input_ids, [[1, 2, 3, 5, 6], [4, 7, 8, 9, 0]])
    np.testing.assert_array_equal(pk.attention_mask, [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    np.testing.assert_array_equal(pk.pos, [[2, 3, 2, 2], [0, 1, 2, 0]])
    np.testing.assert_array_equal(pk.targets, [[5, 6, 0, 0], [7, 8, 9, 0]])
    np.testing.assert_array_equal(pk.mask, [[1, 1, 0, 0], [1, 1, 1, 0]])


def test_to_device_scores_every_token_after_the_prompt_unless_told():
    pk = pack_rows(PROMPTS, TOKENS, 4)
    t = to_device(pk, CPU)
    assert t.input_ids.dtype == torch.int64 and t.mask.dtype == torch.float32
    np.testing.assert_array_equal(t.mask.numpy(), [[1, 1, 0, 0], [1, 1, 1, 0]])
    scored = np.array([[0, 1, 0, 0], [1, 0, 1, 0]], np.float32)
    np.testing.assert_array_equal(to_device(pk, CPU, scored).mask.numpy(), scored)


def test_pack_is_pack_rows_with_the_batch_fields():
    algo = get_algorithm(AlgoConfig(name="grpo"), backend="torch")
    groups = [[Trajectory.single_turn(p, t, np.full(len(t), -1.0), r, "stop") for t, r in zip(TOKENS, (0.0, 1.0),
                                                                                             strict=True)]
              for p in PROMPTS]
    batch = build_batch(groups, algo)
    idx = np.array([3, 0])
    pk, rows = pack(batch, idx), pack_rows([batch.rows[3].prompt, batch.rows[0].prompt],
                                           [batch.rows[3].tokens, batch.rows[0].tokens], batch.width)
    for name in ("input_ids", "attention_mask", "pos", "targets"):
        np.testing.assert_array_equal(getattr(pk, name), getattr(rows, name), err_msg=name)
    np.testing.assert_array_equal(pk.mask, batch.mask[idx])
    np.testing.assert_array_equal(pk.advantages, batch.advantages[idx])


@pytest.fixture(scope="module")
def lm(stoa_cache):
    from transformers import AutoModelForCausalLM

    from stoa.models import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny", cache_dir=stoa_cache), dtype=torch.float32)
    model.config.use_cache = False
    return model.eval()


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_group_score_equals_score_of_the_packed_rows(lm, autocast):
    prompt = np.array([3, 9, 4, 1])
    comps = [np.array([5, 6, 7]), np.array([8]), np.array([2, 2])]
    with torch.no_grad():
        packed = score(lm, pack_tensors([prompt] * 3, comps, 4, CPU), temperature=0.7, autocast=autocast, hits=True)
        shared = group_score(lm, prompt, comps, 4, device=CPU, temperature=0.7, autocast=autocast, hits=True)
    tol = 1e-5 if autocast is None else 5e-2
    torch.testing.assert_close(shared.logp, packed.logp, atol=tol, rtol=tol)
    assert packed.hits is not None and shared.hits is not None
    assert float(packed.logp[1, 1:].abs().sum()) == 0.0  # off the mask: 0
    assert float((packed.logp[0] < 0).sum()) == 3


def test_local_torch_backend_scores_through_the_shared_path(tiny_dir, tmp_path):
    from stoa.config import load_local_config
    from stoa.local.torch_backend import TorchBackend

    cfg = load_local_config(None, {"model": str(tiny_dir), "backend": "torch", "threads": 1, "quant_bits": 8,
                                   "temperature": 0.8, "output_dir": str(tmp_path / "run")})
    be = TorchBackend(cfg, tiny_dir)
    algo = get_algorithm(AlgoConfig(name="grpo"), backend="torch")
    groups = [[Trajectory.single_turn(p, t, np.full(len(t), -1.0), r, "stop") for t, r in zip(TOKENS, (0.0, 1.0),
                                                                                             strict=True)]
              for p in PROMPTS]
    batch = build_batch(groups, algo)
    idx = np.arange(len(batch))
    got = be.logprobs(batch, [idx])
    be.model.eval()
    with torch.no_grad():
        want = score(be.model, to_device(pack(batch, idx), CPU), temperature=0.8).logp.numpy() * batch.mask
    np.testing.assert_array_equal(got, want)


def _saved_shapes(fn):
    """The shapes of the tensors autograd keeps for backward while ``fn`` runs, and its result."""
    shapes: list[tuple[int, ...]] = []

    def keep(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = fn()
    return shapes, out


def test_grouped_keys_on_cpu_keep_no_repeated_keys_and_score_the_same(lm, monkeypatch):
    from transformers.integrations import sdpa_attention

    from stoa.engines.torch_scoring import grouped_keys_on_cpu

    cfg = lm.config
    heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    assert kv_heads < heads and lm.config._attn_implementation == "sdpa"
    grouped_keys_on_cpu()
    grouped_keys_on_cpu()  # idempotent: one wrapper
    patched = sdpa_attention.use_gqa_in_sdpa
    assert not getattr(patched.plain, "grouped_on_cpu", False)
    prompt, comps = np.array([3, 9, 4, 1]), [np.array([5, 6, 7]), np.array([8]), np.array([2, 2])]
    repeated = (3, heads, len(prompt) + 3, head_dim)  # keys of 3 rows over prompt + 3 completion positions

    def run():
        lm.zero_grad()
        shapes, s = _saved_shapes(lambda: group_score(lm, prompt, comps, 4, device=CPU, temperature=0.7))
        s.logp.sum().backward()
        return shapes, s.logp.detach(), lm.get_decoder().layers[0].self_attn.k_proj.weight.grad.clone()

    grouped_shapes, grouped_logp, grouped_grad = run()
    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", patched.plain)
    plain_shapes, plain_logp, plain_grad = run()
    assert repeated in plain_shapes and repeated not in grouped_shapes
    assert (3, kv_heads, len(prompt) + 3, head_dim) in grouped_shapes
    assert torch.equal(grouped_logp, plain_logp)  # the forward is bit-identical
    torch.testing.assert_close(grouped_grad, plain_grad, atol=1e-6, rtol=1e-5)
    with torch.no_grad():  # without gradients transformers decides as before
        key = torch.zeros(1, kv_heads, 2, head_dim)
        assert patched(torch.ones(1, 1, 2, 2, dtype=torch.bool), key, key) is False


def test_the_trainer_and_local_mode_train_with_grouped_keys(tiny_dir, tmp_path, monkeypatch):
    from transformers.integrations import sdpa_attention

    from stoa.config import load_local_config
    from stoa.engines.torch_scoring import grouped_keys_on_cpu
    from stoa.local.torch_backend import TorchBackend
    from stoa.trainer.policy import Policy

    grouped_keys_on_cpu()
    plain = sdpa_attention.use_gqa_in_sdpa.plain
    for build in (lambda: Policy(tiny_dir, CPU),
                  lambda: TorchBackend(load_local_config(None, {"model": str(tiny_dir), "backend": "torch",
                                                                "output_dir": str(tmp_path)}), tiny_dir)):
        monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", plain)
        build()
        assert getattr(sdpa_attention.use_gqa_in_sdpa, "grouped_on_cpu", False)
