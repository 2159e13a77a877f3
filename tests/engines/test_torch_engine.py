"""Torch engine compute dtype: what ``auto`` picks, and bf16 decoding stays close to the fp32 recompute."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import stoa.engines.torch as torch_engine
from stoa.config import ConfigError, WorkerConfig
from stoa.engines.torch import TorchEngine, resolve_dtype


def test_explicit_dtypes_are_kept_and_unknown_is_refused():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("float32", cuda) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype("float16", cpu)


@pytest.mark.parametrize("native", [True, False])
def test_auto_uses_bf16_only_where_it_is_native_and_the_plane_is_exact_in_bf16(monkeypatch, native):
    monkeypatch.setattr(torch_engine, "cpu_has_native_bf16", lambda: native)
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, "bf16") == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("auto", cpu, "int8g64") == torch.float32  # dequantized int8 is not exact in bf16
    assert resolve_dtype("auto", torch.device("cuda"), "int8g64") == torch.bfloat16


def test_worker_config_names_a_bad_dtype():
    with pytest.raises(ConfigError, match="dtype"):
        WorkerConfig(dtype="half").validate()
    assert WorkerConfig().validate().dtype == "auto"


def test_bf16_engine_records_logprobs_close_to_an_fp32_recompute(tiny_dir):
    eng = TorchEngine(tiny_dir, device="cpu", dtype="bfloat16")
    assert eng.dtype == torch.bfloat16
    assert eng.model.config._attn_implementation == "eager"  # the CPU flash kernel is slow in bf16 decode
    prompts = [[5, 9, 14, 20, 3], [7, 7, 30]]
    groups, stats = eng.generate(prompts, 3, max_new_tokens=12, generator=torch.Generator().manual_seed(1))
    assert stats.new_tokens == sum(len(c.tokens) for g in groups for c in g) > 0

    ref = TorchEngine(tiny_dir, device="cpu", dtype="float32")
    assert ref.dtype == torch.float32
    diffs = []
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            ids = torch.tensor([list(prompt) + c.tokens])
            with torch.no_grad():
                logits = ref.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.tokens)[:, None]).squeeze(-1)
            diffs.append(np.abs(lp.numpy() - np.array(c.logprobs)))
    d = np.concatenate(diffs)
    assert d.max() < 0.05, f"bf16 logprobs drift from fp32: max |d| {d.max():.4f}"
    assert d.mean() > 0  # bf16 really ran (an fp32 engine would agree to ~1e-6)


def test_torch_engine_fits_the_protocol_loads_published_states_and_seeds(tiny_dir, tiny_weights):
    from stoa.engines import Engine
    from stoa.weights.planes import state_from_f32, state_to_f32

    eng = TorchEngine(tiny_dir, device="cpu")
    assert isinstance(eng, Engine) and eng.dtype_name == "float32"
    rng = np.random.default_rng(0)
    state = state_from_f32({k: v + rng.standard_normal(v.shape).astype(np.float32) * 0.01
                            for k, v in tiny_weights.items()}, "bf16")
    eng.load_state(state, "bf16")
    got = {k: p.detach().numpy() for k, p in eng.model.named_parameters()}
    assert all(np.array_equal(got[k], v) for k, v in state_to_f32(state, "bf16").items())

    def run(gen):
        groups, _ = eng.generate([[5, 9, 14], [7]], 3, max_new_tokens=8, temperature=1.5, generator=gen)
        return [c.tokens for g in groups for c in g]

    assert run(eng.make_generator(4)) == run(eng.make_generator(4)) == run(torch.Generator().manual_seed(4))
    assert run(eng.make_generator(4)) != run(eng.make_generator(5))


def test_trainer_evaluate_decodes_the_policy_model_and_restores_train_mode(tiny_dir):
    from transformers import AutoModelForCausalLM

    from stoa.tasks import get_task
    from stoa.tokenize import TextCodec
    from stoa.trainer.setup import evaluate

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    model.train()
    ev = evaluate(model, TextCodec(tiny_dir), get_task("arithmetic"), n=3, max_new_tokens=4, batch=2)
    assert model.training
    assert ev["n"] == 3.0 and 0.0 <= ev["accuracy"] <= 1.0 and ev["tokens_per_s"] > 0
