"""Both backends on the tiny model: smoke report, only adapters trainable, micro == whole, adapters off == reference."""

from __future__ import annotations

import numpy as np
import pytest

from stoa.algorithms import get_algorithm
from stoa.algorithms.batch import micro_batches
from stoa.local.loop import make_backend
from stoa.local.smoke import TrainableLeafError, check_only_adapters, smoke_report
from tests.local.conftest import sample_batch

BACKENDS = ["torch", pytest.param("mlx", marks=pytest.mark.mlx)]


def _skip_without(backend: str) -> None:
    if backend == "mlx":
        pytest.importorskip("mlx.core", reason="needs mlx (mlx[cpu] on Linux)")


@pytest.mark.parametrize("backend", BACKENDS)
def test_smoke_report_and_only_adapters(backend, make_cfg, tiny_dir):
    _skip_without(backend)
    lines: list[str] = []
    b = make_backend(make_cfg(backend=backend), tiny_dir)
    s = smoke_report(b, [1, 2, 3, 4], echo=lines.append)
    text = "\n".join(lines)
    assert s.layers == 2 and s.quant_bits == 4 and s.quantized_linears == 14
    assert s.targets_per_layer == [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]] * 2
    # rank 8 over q(64x64) k,v(64x32) o(64x64) gate,up(64x128) down(128x64), two layers
    assert s.trainable_params == 2 * 8 * (128 + 96 + 96 + 128 + 192 + 192 + 192) == 16384
    assert s.total_params == 106816 + 16384  # the tiny llama's 106,816 parameters plus the adapters
    assert "logits_shape:      (1, 4, 512)" in text and "layers 0-1: q_proj, k_proj" in text
    assert all(n.endswith((".lora_a", ".lora_b")) for n in s.trainable_names) and len(s.trainable_names) == 28
    assert s.trainable_names[0] == "model.layers.0.self_attn.q_proj.lora_a"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_trainable_base_leaf_fails_the_smoke_check(backend, make_cfg, tiny_dir):
    _skip_without(backend)
    b = make_backend(make_cfg(backend=backend, lora_targets="q_proj,v_proj"), tiny_dir)
    assert [len(t) for t in b.summary.targets_per_layer] == [2, 2]
    if backend == "torch":
        b.model.model.norm.weight.requires_grad_(True)
        summary = b._summary("tiny")
    else:
        b.model.model.norm.unfreeze()
        summary = b._summary("tiny", "float32")
    with pytest.raises(TrainableLeafError, match="model.norm.weight"):
        check_only_adapters(summary)


def test_smoke_command_exits_1_on_a_trainable_base_leaf(tiny_dir, monkeypatch, capsys):
    import argparse

    from stoa.cli import local as cli
    real = cli.make_backend

    def leaky(cfg, model_dir):
        b = real(cfg, model_dir)
        b.model.model.norm.weight.requires_grad_(True)
        b.summary = b._summary(str(model_dir))
        return b

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["local", "smoke", "--model", str(tiny_dir), "--backend", "torch", "--threads", "1"])
    assert args.func(args) == 0
    assert "smoke: ok" in capsys.readouterr().out
    monkeypatch.setattr(cli, "make_backend", leaky)
    assert args.func(args) == 1
    assert "FAILED: 1 trainable leaves are not LoRA adapters: model.norm.weight" in capsys.readouterr().err


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_micro_batched_gradient_equals_whole_batch(backend, algorithm, make_cfg, tiny_dir):
    """The global normaliser makes accumulation exact; env tokens (mask 0) exercise the multi-turn path."""
    _skip_without(backend)
    cfg = make_cfg(backend=backend, algorithm=algorithm, kl_beta=0.05, gradient_checkpointing=backend == "mlx")
    b = make_backend(cfg, tiny_dir)
    algo = get_algorithm(cfg.algo_config(), b.name)
    batch = sample_batch(b, algo, env_tokens=True)
    whole = micro_batches(len(batch), 0)
    batch.old_logp = b.logprobs(batch, whole)
    batch.ref_logp = b.ref_logprobs(batch, whole)
    b.step(batch, whole, algo)  # move off the initialisation: ratios and KL are no longer trivial
    m_whole = b.accumulate(batch, whole, algo)
    g_whole = b.grad_arrays()
    b.clear_grads()
    m_micro = b.accumulate(batch, micro_batches(len(batch), 3), algo)
    g_micro = b.grad_arrays()
    assert max(float(np.abs(g).max()) for g in g_whole.values()) > 1e-6  # gspo: most sequences clip
    for k, g in g_whole.items():
        np.testing.assert_allclose(g_micro[k], g, rtol=2e-4, atol=1e-7, err_msg=k)
    assert m_micro["loss"] == pytest.approx(m_whole["loss"], rel=1e-4, abs=1e-8)
    assert m_micro["tokens"] == m_whole["tokens"] == float(sum(r.action_mask.sum() for r in batch.rows))
    assert m_whole["ratio_mean"] != 1.0 and m_whole["kl"] > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_old_logprobs_give_ratio_one_and_disabled_adapters_are_the_base(backend, make_cfg, tiny_dir):
    _skip_without(backend)
    cfg = make_cfg(backend=backend, kl_beta=0.1, lr=5e-2)
    b = make_backend(cfg, tiny_dir)
    algo = get_algorithm(cfg.algo_config(), b.name)
    batch = sample_batch(b, algo)
    micro = micro_batches(len(batch), 3)
    base = b.logprobs(batch, micro)
    np.testing.assert_allclose(b.ref_logprobs(batch, micro), base, atol=2e-5)  # fresh adapters: lora_b = 0
    batch.old_logp = base
    batch.ref_logp = base
    m = b.step(batch, micro, algo)
    assert m["ratio_mean"] == 1.0 and m["ratio_max"] == 1.0  # old logprobs: the same full forward
    assert np.abs(b.logprobs(batch, micro) - base).max() > 1e-3
    np.testing.assert_allclose(b.ref_logprobs(batch, micro), base, atol=2e-5)  # adapters off: the base again


@pytest.mark.parametrize("backend", BACKENDS)
def test_reused_old_logprobs_are_the_separate_forwards(backend, make_cfg, tiny_dir):
    """old_logprobs = 'reuse' takes them from the training forward: the same numbers, the same gradient."""
    _skip_without(backend)
    cfg = make_cfg(backend=backend, kl_beta=0.05)
    b = make_backend(cfg, tiny_dir)
    algo = get_algorithm(cfg.algo_config(), b.name)
    batch = sample_batch(b, algo)
    micro = micro_batches(len(batch), 3)
    batch.ref_logp = b.ref_logprobs(batch, micro)
    separate = b.logprobs(batch, micro)
    batch.old_logp = separate
    m_forward = b.accumulate(batch, micro, algo)
    g_forward = b.grad_arrays()
    b.clear_grads()
    batch.old_logp = None
    m_reuse = b.accumulate(batch, micro, algo)
    np.testing.assert_array_equal(batch.old_logp, separate)
    for k, g in b.grad_arrays().items():
        np.testing.assert_array_equal(g, g_forward[k], err_msg=k)
    assert m_reuse == m_forward


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_checkpointing_changes_memory_not_gradients(backend, make_cfg, tiny_dir):
    _skip_without(backend)
    plain = make_backend(make_cfg(backend=backend, kl_beta=0.0), tiny_dir)
    ckpt = make_backend(make_cfg(backend=backend, kl_beta=0.0, gradient_checkpointing=True), tiny_dir)
    algo = get_algorithm(make_cfg(kl_beta=0.0).algo_config(), plain.name)
    batch = sample_batch(plain, algo)
    micro = micro_batches(len(batch), 0)
    batch.old_logp = plain.logprobs(batch, micro)
    for b in (plain, ckpt):
        b.accumulate(batch, micro, algo)
    g_ckpt = ckpt.grad_arrays()
    for k, g in plain.grad_arrays().items():
        np.testing.assert_allclose(g_ckpt[k], g, rtol=1e-5, atol=1e-8, err_msg=k)
