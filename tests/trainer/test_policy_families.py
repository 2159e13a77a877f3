"""The trainer's policy on every tiny family: the shared-prefix forward equals the packed one (values and gradients,
fp32) on MoE and on the lfm2 / qwen3.5 hybrids, a train step changes every weight (each expert included), and
``decoder_blocks`` finds the blocks FSDP and checkpointing wrap."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stoa.algorithms import AlgoConfig, get_algorithm
from stoa.engines.torch_scoring import pack_tensors
from stoa.trainer.policy import Policy, decoder_blocks
from stoa.trainer.step import train_step
from tests.test_trainer_step import make_entries

FAMILIES = ("tiny-qwen3", "tiny-qwen3-moe", "tiny-lfm2", "tiny-lfm2-moe", "tiny-qwen3.5", "tiny-qwen3.5-moe")
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request: pytest.FixtureRequest, stoa_cache: Path) -> Path:
    from stoa.models import resolve_model

    return resolve_model(request.param, cache_dir=stoa_cache)


def _grads(pol: Policy, logp: torch.Tensor) -> dict[str, torch.Tensor]:
    pol.model.zero_grad(set_to_none=True)
    (logp * torch.linspace(0.5, 1.5, logp.shape[1])).sum().backward()
    return {k: p.grad.clone() for k, p in pol.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("t_max", [6, 2])  # 2: the completions' forward is one token (the decode kernels)
def test_shared_prefix_equals_packed_in_values_and_gradients(model_dir: Path, t_max: int):
    pol = Policy(model_dir, CPU, temperature=0.7)
    rng = np.random.default_rng(4)
    prompt = rng.integers(3, 500, 9)
    comps = [rng.integers(3, 500, n) for n in (t_max, 1, max(1, t_max - 2))]
    shared = pol.group_score(prompt, comps, t_max)
    packed = pol.score(pack_tensors([prompt] * len(comps), comps, t_max, CPU))
    torch.testing.assert_close(shared.logp, packed.logp, atol=1e-5, rtol=1e-5)
    g_shared, g_packed = _grads(pol, shared.logp), _grads(pol, packed.logp)
    assert g_shared.keys() == g_packed.keys() and len(g_packed) == len(list(pol.model.parameters()))
    for k in g_packed:  # per tensor, relative to its largest entry (qwen3.5's chunked delta rule reorders sums)
        scale = float(g_packed[k].abs().max())
        assert float((g_shared[k] - g_packed[k]).abs().max()) <= 1e-4 * scale + 1e-6, k


def test_decoder_blocks_are_the_models_layers(model_dir: Path):
    pol = Policy(model_dir, CPU)
    blocks = decoder_blocks(pol.model)
    assert len(blocks) == pol.model.config.get_text_config().num_hidden_layers
    assert all(type(b).__name__.endswith("DecoderLayer") for b in blocks)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_train_step_changes_every_weight_and_every_expert(model_dir: Path, checkpointing: bool):
    torch.manual_seed(0)
    pol = Policy(model_dir, CPU, gradient_checkpointing=checkpointing)
    before = {k: v.detach().clone() for k, v in pol.model.named_parameters()}
    opt = torch.optim.SGD(pol.model.parameters(), lr=1.0)
    algo = get_algorithm(AlgoConfig.from_dict({"name": "grpo", "kl_beta": 0.0, "max_tokens": 6}), "torch")
    m = train_step(pol, None, opt, algo, make_entries(groups=4), current_version=2, micro_batch=4, grad_clip=0.0)
    assert np.isfinite(m["loss"]) and m["tokens"] > 0
    for k, p in pol.model.named_parameters():
        delta = (p.detach() - before[k]).abs()
        if ".experts." in k:  # fused [experts, ...]: every expert got tokens and moved
            assert bool((delta.flatten(1).amax(1) > 0).all()), k
        else:
            assert float(delta.max()) > 0, k


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-qwen3.5-moe"])
def test_the_fp32_trainer_routes_every_token_as_the_worker_did(name: str, stoa_cache: Path):
    """The drift bench's router hooks: fp32 trainer vs fp32 worker agree on every expert set and logprob; bf16
    autocast flips some (the measurement sees what it is meant to)."""
    from stoa.bench.checkout import load_script

    family_report = load_script("family_drift.py").family_report

    r = family_report(name, groups=2, n=4, max_new=16, temperature=1.0, seed=0, mlx=False)
    fp32, bf16 = r["fp32_vs_torch32"], r["bf16_vs_torch32"]
    assert r["moe"] and fp32["route_flip"] == 0.0 and fp32["max_abs"] < 1e-5 and fp32["mean_ratio"] == pytest.approx(1)
    assert bf16["route_flip"] > 0.0 and bf16["mean_abs"] > 1e-3


def test_the_published_state_carries_the_expert_bias_a_config_only_worker_needs(stoa_cache: Path, tmp_path: Path):
    """lfm2-moe's expert bias is a buffer, never trained, yet it picks the experts: a worker that builds the model
    from config.json alone (the bucket's model files) gets it only through the published state."""
    import shutil

    from stoa.engines.torch import TorchEngine
    from stoa.models import resolve_model
    from stoa.weights.planes import state_from_f32

    src = resolve_model("tiny-lfm2-moe", cache_dir=stoa_cache)
    pol = Policy(src, CPU, trainable=False)
    f32 = pol.export_f32()
    names = [k for k in f32 if k.endswith("expert_bias")]
    assert names and names == pol.buffer_names and all(np.abs(f32[k]).max() > 0 for k in names)
    for k in names:  # rounded to bf16 once, so the bf16 bits the planes carry are exactly the trainer's values
        assert np.array_equal(f32[k], torch.from_numpy(f32[k]).bfloat16().float().numpy())
    config_only = tmp_path / "model"
    config_only.mkdir()
    for f in src.iterdir():
        if f.suffix in (".json", ".jinja", ".txt"):
            shutil.copy(f, config_only / f.name)
    eng = TorchEngine(config_only, dtype="float32")
    eng.load_state(state_from_f32(f32, "bf16"), "bf16")
    for k in names:
        assert torch.equal(eng.model.get_buffer(k), pol.model.get_buffer(k))
