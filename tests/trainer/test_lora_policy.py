"""The trainer's LoRA policy (tiny model, fp32, CPU): step 0 is the base, only the adapter trains, the base stays
bit-identical, the export is the merged weights, a checkpoint holds the adapter and its AdamW state only (plus
the base's identity) and resumes to the same next step, PEFT files, and bad settings refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from stoa.algorithms import AlgoConfig, get_algorithm
from stoa.bucket import open_bucket
from stoa.config import ConfigError, TrainerConfig
from stoa.engines.torch_scoring import pack_tensors
from stoa.layout import checkpoint_files_prefix, checkpoint_pointer_key
from stoa.models.lora_torch import DEFAULT_TARGETS, LoraSpec, add_lora, is_adapter
from stoa.trainer import checkpoint as ckpt
from stoa.trainer.lora import Identity, base_fingerprint, lora_spec
from stoa.trainer.policy import Policy
from stoa.trainer.step import train_step
from tests.test_trainer_step import make_entries

CPU = torch.device("cpu")
SPEC = LoraSpec(4, 8.0)
ALGO = get_algorithm(AlgoConfig.from_dict({"name": "grpo", "kl_beta": 0.0, "max_tokens": 6}), "torch")


def _lora(tiny_dir: Path, seed: int = 0) -> tuple[Policy, torch.optim.Optimizer]:
    pol = Policy(tiny_dir, CPU, lora=SPEC, seed=seed)
    return pol, torch.optim.AdamW(pol.trainable_parameters(), lr=1e-2)


def _step(pol: Policy, opt: torch.optim.Optimizer, seed: int) -> float:
    m = train_step(pol, None, opt, ALGO, make_entries(seed), current_version=2, grad_clip=1.0, micro_batch=4)
    return float(m["loss"])


def _logp(pol: Policy) -> torch.Tensor:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 500, 7) for _ in range(3)]
    comps = [rng.integers(3, 500, n) for n in (5, 2, 4)]
    with torch.no_grad():
        return pol.logprobs(pack_tensors(prompts, comps, 5, CPU))


def test_step_zero_is_the_base_and_only_adapters_train(tiny_dir: Path):
    base, (pol, opt) = Policy(tiny_dir, CPU), _lora(tiny_dir)
    assert torch.equal(_logp(pol), _logp(base))  # B = 0: the adapter adds exactly nothing
    n_linear = sum(1 for n, m in pol.model.named_modules()
                   if isinstance(m, torch.nn.Linear) and n.endswith(DEFAULT_TARGETS))
    trainable = {k for k, p in pol.model.named_parameters() if p.requires_grad}
    assert trainable == {k for k in pol.named_parameters() if is_adapter(k)} and len(trainable) == 2 * n_linear
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in pol.trainable_parameters()}
    before = {k: p.detach().clone() for k, p in pol.model.named_parameters()}
    for s in range(2):
        _step(pol, opt, s)
    after = dict(pol.model.named_parameters())
    for k, p in after.items():
        if is_adapter(k):
            assert not torch.equal(p, before[k]), k  # A and B both move (B from zero)
        else:
            assert torch.equal(p, before[k]), k  # the base is bit-identical
    assert not torch.equal(_logp(pol), _logp(base))
    assert all(len(s) == 0 or k in {id(p) for p in pol.trainable_parameters()}
               for k, s in ((id(p), opt.state.get(p, {})) for p in pol.model.parameters()))


def test_the_export_is_the_merged_weights_under_the_bases_names(tiny_dir: Path):
    pol, opt = _lora(tiny_dir)
    _step(pol, opt, 0)
    merged = pol.export_f32()
    assert set(merged) == set(Policy(tiny_dir, CPU).export_f32())  # the planes see the full model's names
    named = pol.named_parameters()
    for path in pol.lora_paths:
        w, a, b = (named[f"{path}.{x}"].detach() for x in ("weight", "lora_A.weight", "lora_B.weight"))
        assert float(b.abs().max()) > 0
        np.testing.assert_allclose(merged[f"{path}.weight"], (w + SPEC.scale * b @ a).numpy(), rtol=0, atol=1e-6)
    untouched = [k for k in merged if not any(k.startswith(p + ".") for p in pol.lora_paths)]
    assert untouched and all(np.array_equal(merged[k], named[k].detach().numpy()) for k in untouched)
    # The merged model scores as the adapted one does.
    full = Policy(tiny_dir, CPU)
    full.load_f32(merged)
    torch.testing.assert_close(_logp(full), _logp(pol), atol=2e-5, rtol=0)


def test_a_checkpoint_holds_the_adapter_and_resumes_to_the_same_next_step(tiny_dir: Path, tmp_path: Path):
    bucket = open_bucket(str(tmp_path / "b"))
    ident = Identity(base_fingerprint(tiny_dir), SPEC, "tiny")
    pol, opt = _lora(tiny_dir)
    _step(pol, opt, 0)
    ckpt.save_checkpoint(bucket, "r", pol.model, opt, version=2, step=1, echo=lambda s: None, identity=ident)
    ref = ckpt.read_pointer(bucket, "r")
    assert ref is not None and ref.adapter == SPEC.describe() and ref.base == ident.base
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    local = tmp_path / "dcp"
    local.mkdir()
    for name in ref.files:
        bucket.get_file(checkpoint_files_prefix("r", ref.tag) + name, str(local / name))
    keys = FileSystemReader(str(local)).read_metadata().state_dict_metadata
    params = {k.split(".", 1)[1] for k in keys if k.startswith("model.")}
    assert params == {k for k in pol.named_parameters() if is_adapter(k)}  # no base tensor
    moments = {k for k in keys if k.startswith("optim.state.")}
    assert moments and all(".lora_A." in k or ".lora_B." in k for k in moments)

    pol2, opt2 = _lora(tiny_dir, seed=7)  # another initialisation: the checkpoint must replace it
    restored = ckpt.load_checkpoint(bucket, "r", pol2.model, opt2, echo=lambda s: None, identity=ident)
    assert restored is not None and (restored.version, restored.step) == (2, 1)
    assert _step(pol2, opt2, 1) == _step(pol, opt, 1)  # identical next-step loss
    for (k, p), q in zip(pol.model.named_parameters(), pol2.model.parameters(), strict=True):
        assert torch.equal(p, q), k  # and identical weights after it (the AdamW moments came back too)


def test_a_checkpoint_of_another_adapter_or_base_or_a_full_fine_tune_is_refused(tiny_dir: Path, tmp_path: Path):
    bucket = open_bucket(str(tmp_path / "b"))
    ident = Identity(base_fingerprint(tiny_dir), SPEC, "tiny")
    pol, opt = _lora(tiny_dir)
    ckpt.save_checkpoint(bucket, "r", pol.model, opt, version=1, step=0, echo=lambda s: None, identity=ident)
    other = Identity(ident.base, LoraSpec(8, 8.0), "tiny")
    with pytest.raises(ckpt.CheckpointError, match="holds a LoRA adapter"):
        ckpt.load_checkpoint(bucket, "r", pol.model, opt, echo=lambda s: None, identity=other)
    with pytest.raises(ckpt.CheckpointError, match="of base"):
        ckpt.load_checkpoint(bucket, "r", pol.model, opt, echo=lambda s: None,
                             identity=Identity("Llama:x:y", SPEC, "tiny"))
    with pytest.raises(ckpt.CheckpointError, match="export --source published"):
        ckpt.checkpoint_params(bucket, "r")  # the adapter alone is not a model to export
    full = Policy(tiny_dir, CPU)
    full_opt = torch.optim.AdamW(full.trainable_parameters())
    ckpt.save_checkpoint(bucket, "f", full.model, full_opt, version=1, step=0, echo=lambda s: None)
    with pytest.raises(ckpt.CheckpointError, match="full fine-tune"):
        ckpt.load_checkpoint(bucket, "f", pol.model, opt, echo=lambda s: None, identity=ident)


def test_the_checkpoint_writes_peft_adapter_files(tiny_dir: Path, tmp_path: Path):
    bucket = open_bucket(str(tmp_path / "b"))
    pol, opt = _lora(tiny_dir)
    _step(pol, opt, 0)
    ckpt.save_checkpoint(bucket, "r", pol.model, opt, version=2, step=1, echo=lambda s: None,
                         identity=Identity(base_fingerprint(tiny_dir), SPEC, "tiny"))
    ref = ckpt.read_pointer(bucket, "r")
    assert ref is not None
    prefix = checkpoint_files_prefix("r", ref.tag) + "adapter/"
    bucket.get_file(prefix + "adapter_model.safetensors", str(tmp_path / "a.safetensors"))
    tensors = load_file(str(tmp_path / "a.safetensors"))
    config = json.loads(bucket.get(prefix + "adapter_config.json"))
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["target_modules"] == list(DEFAULT_TARGETS)
    named = pol.named_parameters()
    q = "model.layers.0.self_attn.q_proj"
    assert f"base_model.model.{q}.lora_A.weight" in tensors
    assert set(tensors) == {f"base_model.model.{k}" for k in named if is_adapter(k)}
    for key, value in tensors.items():
        np.testing.assert_array_equal(value, named[key.removeprefix("base_model.model.")].detach().numpy())
    lin = pol.model.get_submodule(q)
    assert tensors[f"base_model.model.{q}.lora_A.weight"].shape == (4, lin.in_features)  # PEFT: A [r, in]
    assert tensors[f"base_model.model.{q}.lora_B.weight"].shape == (lin.out_features, 4)  # B [out, r]


@pytest.mark.parametrize(("kw", "field"), [
    ({"lora_rank": -1}, "lora_rank"),
    ({"lora_rank": 4, "lora_alpha": 0.0}, "lora_alpha"),
    ({"lora_rank": 4, "lora_targets": " , "}, "lora_targets"),
    ({"lora_rank": 4, "lora_targets": "q_proj,self attn"}, "lora_targets"),
])
def test_bad_lora_settings_are_refused_naming_the_field(kw: dict, field: str):
    with pytest.raises(ConfigError) as e:
        TrainerConfig(**kw).validate()
    assert e.value.field == field and ";" in str(e.value) or "must be" in str(e.value)


def test_the_settings_make_the_spec_and_targets_that_name_nothing_are_refused(tiny_dir: Path):
    cfg = TrainerConfig(lora_rank=8, lora_alpha=16.0, lora_targets="q_proj, v_proj").validate()
    assert lora_spec(cfg) == LoraSpec(8, 16.0, ("q_proj", "v_proj")) and lora_spec(TrainerConfig()) is None
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="lora_targets"):
        add_lora(AutoModelForCausalLM.from_pretrained(tiny_dir), LoraSpec(2, 4.0, ("nothing_here",)), 0)


def test_the_preflight_counts_gradients_and_adamw_on_the_adapter_only():
    from stoa.config.memory import lora_params
    from stoa.models.shapes import shape_for
    from stoa.trainer.peak import Workload, estimate_peak, workload

    shape = shape_for("smollm2-135m")
    assert shape is not None
    n = lora_params(shape, 16, DEFAULT_TARGETS)
    assert n == 30 * 16 * (2 * (576 + 576) + 2 * (576 + 192) + 3 * (576 + 1536))  # PEFT's count for r=16
    cfg = TrainerConfig(lora_rank=16, n_samples=8, groups_per_step=2).validate()
    work = workload(cfg, 48, 64, 1, False, False)
    assert work.lora_rank == 16 and work.lora_targets == DEFAULT_TARGETS
    full, lora = estimate_peak(shape, work._replace(lora_rank=0)), estimate_peak(shape, work)
    assert lora.optimizer == pytest.approx(n * 8 / 1e9) and lora.gradients == pytest.approx(n * 4 / 1e9)
    assert full.optimizer == pytest.approx(shape.params() * 8 / 1e9)
    assert lora.parameters == pytest.approx(full.parameters + n * 4 / 1e9)  # fp32 base (fp32 compute) + adapter
    bf16 = estimate_peak(shape, Workload(16, 48, 64, False, False, 1, False, True, 16, DEFAULT_TARGETS))
    assert bf16.parameters == pytest.approx((shape.params() * 2 + n * 4) / 1e9)  # the base stored in bf16


def test_a_lora_trainer_resumes_from_its_checkpoint_and_refuses_merged_weights_alone(tmp_path: Path, stoa_cache):
    from stoa.trainer.loop import _Trainer
    from tests.test_trainer_resume import make_cfg

    url = str(tmp_path / "b")
    cfg = make_cfg(url, lora_rank=4, lora_alpha=8.0)
    t1 = _Trainer(cfg, echo=lambda *_: None)
    t1.resume()  # a new run: publishes v1 (the merged weights: the base, B = 0)
    stepped = {id(p) for g in t1.opt.param_groups for p in g["params"]}
    assert stepped == {id(p) for p in t1.policy.trainable_parameters()}  # AdamW holds the adapter only
    assert len(t1.policy.trainable_parameters()) == 2 * len(t1.policy.lora_paths)
    with torch.no_grad():
        for k, p in t1.policy.named_parameters().items():
            if k.endswith("lora_B.weight"):
                p.fill_(0.01)  # as if trained
    t1.publish(2)
    t1.ops.save(2, 1)
    adapter = t1.policy.adapter_f32()
    t1.close()

    lines: list[str] = []
    t2 = _Trainer(make_cfg(url, lora_rank=4, lora_alpha=8.0), echo=lines.append)
    t2.resume()
    assert t2.version == 2 and t2.step == 1 and t2.lag0_trusted
    assert all(np.array_equal(v, adapter[k]) for k, v in t2.policy.adapter_f32().items())
    t2.publish(3)  # a third version the checkpoint (v2) is behind: the adapter stays the checkpoint's
    t2.close()
    t3 = _Trainer(make_cfg(url, lora_rank=4, lora_alpha=8.0), echo=lines.append)
    t3.resume()
    assert any("continuing from the checkpoint's adapter (v2)" in line for line in lines)
    assert not t3.lag0_trusted  # its weights are v2's, not the published v3's: lag-0 records are not judged
    assert all(np.array_equal(v, adapter[k]) for k, v in t3.policy.adapter_f32().items())
    t3.close()

    open_bucket(url).delete(checkpoint_pointer_key("r"))
    t4 = _Trainer(make_cfg(url, lora_rank=4, lora_alpha=8.0), echo=lines.append)
    with pytest.raises(SystemExit, match="checkpoint_every = 1"):
        t4.resume()
    t4.close()


def test_the_base_is_stored_in_the_compute_dtype_and_checkpointing_gives_the_same_step(tiny_dir: Path):
    bf16 = Policy(tiny_dir, CPU, lora=SPEC, compute_dtype=torch.bfloat16)
    dtypes = {k: p.dtype for k, p in bf16.named_parameters().items()}
    assert all(d == (torch.float32 if is_adapter(k) else torch.bfloat16) for k, d in dtypes.items())
    assert bf16.autocast and np.isfinite(_logp(bf16).numpy()).all()
    deltas = []
    for checkpointing in (False, True):
        pol = Policy(tiny_dir, CPU, lora=SPEC, gradient_checkpointing=checkpointing)
        opt = torch.optim.AdamW(pol.trainable_parameters(), lr=1e-2)
        _step(pol, opt, 0)
        deltas.append(pol.adapter_f32())
    assert deltas[0].keys() == deltas[1].keys()
    for k in deltas[0]:
        np.testing.assert_allclose(deltas[0][k], deltas[1][k], atol=1e-4, rtol=0)  # AdamW steps are 1e-2


def test_a_lora_runs_reference_is_its_own_base_with_the_adapters_bypassed(tiny_dir: Path):
    from stoa.trainer.peak import workload
    from stoa.trainer.policy import BaseView

    base, (pol, _opt) = Policy(tiny_dir, CPU, trainable=False), _lora(tiny_dir)
    with torch.no_grad():
        for k, p in pol.model.named_parameters():
            if k.endswith("lora_B.weight"):
                p.normal_(0.0, 0.05)
    ref = BaseView(pol)
    rng = np.random.default_rng(1)
    prompt, comps = rng.integers(3, 500, 7), [rng.integers(3, 500, n) for n in (5, 2, 4)]
    with torch.no_grad():
        packed = pack_tensors([prompt] * 3, comps, 5, CPU)
        assert torch.equal(ref.logprobs(packed), base.logprobs(packed))
        assert torch.equal(ref.group_logprobs(prompt, comps, 5), base.group_logprobs(prompt, comps, 5))
        assert not torch.equal(pol.logprobs(packed), base.logprobs(packed))  # the adapters are on again after
    with pytest.raises(ValueError, match="needs a LoRA policy"):
        BaseView(base)
    kl = {"name": "grpo", "kl_beta": 0.04}
    assert workload(TrainerConfig(algo=kl).validate(), 48, 64, 1, False).reference  # the preflight: no second base
    assert not workload(TrainerConfig(lora_rank=8, algo=kl).validate(), 48, 64, 1, False).reference
