"""``stoa local export``: a tiny local run's adapters fused into its dequantized base load in transformers and
compute what the run's own model computes; the mlx-lm adapter layout sits next to it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stoa.local.fuse import export_local
from stoa.models.hf_dir import ExportError

PROMPTS = [[1, 5, 9, 13], [2, 7, 11], [3, 30, 40, 50, 60]]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, stoa_cache):
    """Two steps of a tiny torch local run (4-bit base), saved; and its model with the saved adapters."""
    from stoa.config.local import load_local_config
    from stoa.local.loop import make_backend, run_local
    from stoa.local.saved import find_latest
    from stoa.models import resolve_model

    out = tmp_path_factory.mktemp("local") / "run"
    cfg = load_local_config(None, {"model": str(resolve_model("tiny")), "task": "toy", "backend": "torch",
                                   "threads": 1, "eval_n": 0, "n_samples": 4, "groups_per_step": 2,
                                   "max_new_tokens": 8, "max_prompt_tokens": 64, "output_dir": str(out),
                                   "steps": 2, "lr": 5e-2, "kl_beta": 0.0})
    run_local(cfg, echo=lambda _s: None)
    saved = find_latest(out)
    assert saved is not None and saved.step == 2
    assert any(np.abs(v).max() > 0 for k, v in saved.adapters.items() if k.endswith("lora_b"))  # it trained
    backend = make_backend(cfg, resolve_model("tiny"))
    backend.load_adapter_arrays(saved.adapters)
    return out, backend


def _hf_logits(out, prompt):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits[0].numpy(), model


def test_fused_export_computes_what_the_local_model_computes(local_run, tmp_path):
    import torch

    run_dir, backend = local_run
    out = tmp_path / "hf"
    result = export_local(run_dir, out, echo=lambda _s: None)
    assert result.step == 2 and result.fused == len(backend.lora_paths) > 0
    for prompt in PROMPTS:
        got, model = _hf_logits(out, prompt)
        with torch.no_grad():
            want = backend.model(input_ids=torch.tensor([prompt])).logits[0].float().numpy()
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    groups, _ = backend.rollout(PROMPTS, 1, max_new_tokens=6, temperature=1.0, top_p=1.0, eos_ids=[], seed=0,
                                greedy=True)
    for prompt, group in zip(PROMPTS, groups, strict=True):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(6):
                seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        assert seq[len(prompt):] == list(group[0].tokens)


def test_the_mlx_adapter_layout_is_written_next_to_it(local_run, tmp_path):
    from safetensors.numpy import load_file

    run_dir, backend = local_run
    result = export_local(run_dir, tmp_path / "hf", dtype="bfloat16", echo=lambda _s: None)
    config = json.loads((result.adapters / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and config["lora_parameters"]["rank"] == backend.cfg.lora_rank
    arrays = load_file(str(result.adapters / "adapters.safetensors"))
    assert set(arrays) == set(backend.adapter_arrays())
    assert json.loads((result.out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_the_peft_adapter_merges_into_the_dequantized_base_as_the_export_fused_it(local_run, tmp_path):
    """The PEFT files are the trainer's (``write_peft``): its keys and config; ``merge_arrays`` (what ``stoa export``
    merges with) on the run's dequantized base gives the fused export's weights."""
    from safetensors.numpy import load_file

    from stoa.models.lora_torch import PEFT_PREFIX, merge_arrays
    from stoa.models.quant_torch import QuantLinear

    run_dir, backend = local_run
    result = export_local(run_dir, tmp_path / "hf", echo=lambda _s: None)
    config = json.loads((result.peft / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == backend.cfg.lora_rank
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    saved = load_file(str(result.peft / "adapter_model.safetensors"))
    peft = {k.removeprefix(PEFT_PREFIX): v for k, v in saved.items()}
    assert sorted(peft) == sorted(f"{p}.lora_{m}.weight" for p in backend.lora_paths for m in "AB")
    base = {}
    for path in backend.lora_paths:
        lin = backend.model.get_submodule(path)
        assert isinstance(lin, QuantLinear)
        base[f"{path}.weight"] = lin.dequantized().numpy()
    merged = merge_arrays({**base, **peft}, backend.lora_paths, backend.spec.scale)
    fused = load_file(str(result.out / "model.safetensors"))
    for name, w in merged.items():
        np.testing.assert_allclose(fused[name], w, atol=1e-6, rtol=1e-6)


def test_refusals_name_the_fix(local_run, tmp_path):
    run_dir, _ = local_run
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="holds no saved local run"):
        export_local(tmp_path / "empty", tmp_path / "a", echo=lambda _s: None)
    with pytest.raises(ExportError, match="is not empty"):
        export_local(run_dir, run_dir, echo=lambda _s: None)


def test_fusing_keeps_the_outputs_of_adapted_and_merely_quantized_linears(make_cfg, tiny_dir):
    import torch

    from stoa.local.fuse import fuse_into_linears
    from stoa.local.loop import make_backend
    from stoa.models.quant_torch import QuantLinear

    backend = make_backend(make_cfg(lora_targets="q_proj,v_proj", torch_base="dequantized"), tiny_dir)
    rng = np.random.default_rng(0)
    backend.load_adapter_arrays({k: rng.standard_normal(v.shape).astype(np.float32) * 0.1
                                 for k, v in backend.adapter_arrays().items()})
    assert any(isinstance(m, QuantLinear) for m in backend.model.modules())  # o_proj, mlp: quantized only
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        before = backend.model(input_ids=ids).logits.numpy()
        assert fuse_into_linears(backend.model) == 2 * 2  # q_proj and v_proj of two layers
        after = backend.model(input_ids=ids).logits.numpy()
    assert not any(isinstance(m, QuantLinear) for m in backend.model.modules())
    names = {k for k, _ in backend.model.named_parameters()}
    assert "model.layers.0.mlp.down_proj.weight" in names and not any("lora" in k for k in names)
    assert not any(".linear." in k for k in names)  # the wrapped base is fused once, not kept beside it
    np.testing.assert_allclose(after, before, atol=2e-5, rtol=1e-5)
