"""A LoRA fleet run on the adapter plane (tiny model, local bucket): the trainer publishes its base once and adapter
versions; a torch worker rebuilds the adapter bit-exact, samples with base + adapter and its logprobs are the
trainer's; a worker on another base, a damaged base and an engine without adapters are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import stoa.worker.loop as wloop
from stoa.bucket import open_bucket
from stoa.config import WorkerConfig, load_config
from stoa.contract import ContractMismatch, RunContract, download_model_files
from stoa.engines.adapter import prepare_adapter
from stoa.engines.torch import TorchEngine
from stoa.layout import ANCHOR_FILE, base_prefix, contract_key, patch_key
from stoa.weights.adapter import adapter_state, is_adapter_name
from stoa.weights.planes import bf16_bits_to_f32, f32_to_bf16_bits, state_from_f32
from stoa.weights.pulse import read_patch_header
from stoa.weights.sync import WeightSync
from tests.test_trainer_resume import make_cfg


def _bf16(x: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(f32_to_bf16_bits(x))


@pytest.fixture(scope="module")
def run(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A LoRA trainer (fp32, base and adapter bf16-exact so both sides compute the same numbers) that published
    v1 and a trained-looking v2; the trainer stays open for scoring."""
    from stoa.trainer.loop import _Trainer

    tmp = tmp_path_factory.mktemp("lora-run")
    model = tmp / "base"
    shutil.copytree(tiny_dir, model)
    w = load_file(str(model / "model.safetensors"))
    save_file({k: _bf16(v) for k, v in w.items()}, str(model / "model.safetensors"), metadata={"format": "pt"})
    url = str(tmp / "b")
    t = _Trainer(make_cfg(url, model=str(model), lora_rank=4, lora_alpha=8.0, dtype="float32"), echo=lambda *_: None)
    t.resume()  # v1: the adapter plane's anchor (B = 0)
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for k, p in t.policy.named_parameters().items():
            if is_adapter_name(k):  # as if trained; bf16-exact values
                new = _bf16(p.detach().numpy() + 0.05 * rng.standard_normal(p.shape).astype(np.float32))
                p.copy_(torch.from_numpy(new))
    t.publish(2)
    yield {"t": t, "url": url, "model": model, "tmp": tmp}
    t.close()


def _worker(run: dict[str, Any], name: str, engine: str = "torch") -> tuple[Any, RunContract, Any, Path]:
    bucket = open_bucket(run["url"])
    contract = RunContract.from_json(bucket.get(contract_key("r")))
    wdir = download_model_files(bucket, "r", run["tmp"] / name)  # config and tokenizer only: no weights
    if engine == "mlx":
        from stoa.engines.mlx.engine import MLXEngine

        return bucket, contract, MLXEngine(wdir, dtype="float32"), wdir
    return bucket, contract, TorchEngine(wdir, device="cpu", dtype="float32"), wdir


def _worst_gap(engine: Any, t: Any) -> float:
    """The largest gap between the logprobs the engine sampled with and the trainer's sampling forward."""
    prompts = [[5, 17, 42, 9], [7, 7, 100, 3, 250]]
    groups, _ = engine.generate(prompts, 2, max_new_tokens=6, generator=engine.make_generator(0))
    worst = 0.0
    with torch.no_grad(), t.policy.sampling():
        for prompt, group in zip(prompts, groups, strict=True):
            comps = [np.array(c.tokens) for c in group]
            logp = t.policy.group_logprobs(np.array(prompt), comps, max(len(c) for c in comps)).numpy()
            for row, c in zip(logp, group, strict=True):
                worst = max(worst, float(np.abs(row[: len(c.tokens)] - np.array(c.logprobs)).max()))
    return worst


def test_a_worker_rebuilds_the_adapter_bit_exact_and_scores_as_the_trainer(run: dict[str, Any]):
    t = run["t"]
    bucket, contract, engine, wdir = _worker(run, "w1")
    spec = contract.adapter_spec
    assert contract.weight_plane == "adapter" and spec is not None and (spec.rank, spec.alpha) == (4, 8.0)
    assert t.publisher.pointer.plane == "adapter"
    patched = read_patch_header(bucket.get(patch_key("r", 2))).tensor_hashes
    assert patched and all(is_adapter_name(k) for k in patched)  # the patch carries the adapter only

    check = prepare_adapter(engine, "torch", bucket, contract, wdir, echo=lambda *_: None)
    sync = WeightSync(bucket, "r", contract.weight_plane, run_key=contract.run_key, check=check)
    version, state = sync.sync()
    want = adapter_state(t.policy.adapter_f32())
    assert version == 2 and state.keys() == want.keys()
    assert all(np.array_equal(state[k], want[k]) for k in want)  # bit-exact
    engine.load_state(state, contract.weight_plane)
    worst = _worst_gap(engine, t)
    assert worst < 1e-4, worst  # the worker's LoRA forward is the trainer's


def test_an_mlx_worker_rebuilds_the_adapter_and_scores_as_the_trainer(run: dict[str, Any]):
    pytest.importorskip("mlx.core", reason="needs mlx (mlx[cpu] on Linux)")
    bucket, contract, engine, wdir = _worker(run, "m1", engine="mlx")
    check = prepare_adapter(engine, "mlx", bucket, contract, wdir, echo=lambda *_: None)
    sync = WeightSync(bucket, "r", contract.weight_plane, run_key=contract.run_key, check=check)
    version, state = sync.sync()
    assert version == 2
    engine.load_state(state, contract.weight_plane)
    worst = _worst_gap(engine, run["t"])
    assert worst < 1e-4, worst


def test_run_worker_samples_a_lora_run_from_the_bucket_alone(run: dict[str, Any], tmp_path: Path):
    cfg = load_config(WorkerConfig, env={}, overrides={
        "bucket": run["url"], "run": "r", "name": "lw", "engine": "torch", "threads": 1, "max_groups": 1,
        "groups_in_flight": 1, "poll_seconds": 0.01, "wait_seconds": 5, "seed": 1, "log_dir": str(tmp_path / "l")})
    lines: list[str] = []
    s = wloop.run_worker(cfg, echo=lines.append)
    assert s["groups"] == 1 and s["versions"] == [2]
    assert any("LoRA run: base verified" in line for line in lines)


def test_a_worker_on_another_base_or_a_damaged_base_or_without_adapters_is_refused(run: dict[str, Any]):
    bucket, contract, engine, wdir = _worker(run, "w2")
    with pytest.raises(ContractMismatch, match="cannot apply"):
        prepare_adapter(object(), "other", bucket, contract, wdir)
    cfg = json.loads((wdir / "config.json").read_text())
    (wdir / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-3}))  # another base
    with pytest.raises(ContractMismatch, match="wrong_base"):
        prepare_adapter(engine, "torch", bucket, contract, wdir)
    (wdir / "config.json").write_text(json.dumps(cfg))
    key = base_prefix("r") + ANCHOR_FILE
    good = bucket.get(key)
    bucket.put(key, good[:-1] + bytes([good[-1] ^ 1]))  # a corrupt base object
    try:
        with pytest.raises(ContractMismatch, match="hash_mismatch"):
            prepare_adapter(engine, "torch", bucket, contract, wdir)
    finally:
        bucket.put(key, good)


def test_the_evaluator_follows_a_lora_run_on_base_plus_adapter(run: dict[str, Any], tmp_path: Path):
    from stoa.evaluator import EvalConfig, run_evaluator

    cfg = EvalConfig(bucket=run["url"], run="r", engine="torch", n=2, threads=1, log_dir=str(tmp_path / "logs"))
    lines: list[str] = []
    assert run_evaluator(cfg, echo=lines.append).evaluated == [2]
    assert any("LoRA run: base verified" in line for line in lines)


def test_the_published_export_of_a_lora_run_is_the_merged_model(run: dict[str, Any], tmp_path: Path):
    from stoa.export import export_run

    res = export_run(open_bucket(run["url"]), "r", tmp_path / "out", echo=lambda *_: None)
    assert res.version == 2 and res.dtype == "bfloat16"
    got = {k: v.view(np.uint16) if v.dtype.itemsize == 2 else v for k, v in _load_bf16(tmp_path / "out").items()}
    want = state_from_f32(run["t"].policy.export_f32(), "bf16")  # the trainer's merge, rounded to bf16
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def _load_bf16(d: Path) -> dict[str, np.ndarray]:
    from safetensors.torch import load_file as load_torch

    return {k: v.view(torch.int16).numpy() for k, v in load_torch(str(d / "model.safetensors")).items()}


def test_a_trainer_restarted_without_model_rebuilds_the_base_it_published(run: dict[str, Any], tmp_path: Path):
    from stoa.trainer.setup import model_from_bucket

    bucket = open_bucket(run["url"])
    contract = RunContract.from_json(bucket.get(contract_key("r")))
    dest = model_from_bucket(bucket, "r", contract.plane, tmp_path / "m", adapter=contract.adapter_spec)
    got = load_file(str(dest / "model.safetensors"))
    want = load_file(str(run["model"] / "model.safetensors"))  # bf16-exact values: the plane keeps them
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def test_a_trainer_whose_base_weights_differ_from_the_published_base_is_refused(tmp_path: Path):
    from types import SimpleNamespace

    from stoa.models.lora_torch import LoraSpec
    from stoa.trainer.lora import Identity, publish_adapter_base

    bucket, cfg = open_bucket(str(tmp_path / "b")), SimpleNamespace(run="r", plane="bf16")
    ident = Identity("llama:c:t", LoraSpec(4, 8.0))
    base = {"w.weight": np.ones((2, 64), np.float32)}
    spec = publish_adapter_base(bucket, cfg, ident, base, print).spec
    assert (spec.base, spec.rank, spec.alpha) == ("llama:c:t", 4, 8.0)
    assert publish_adapter_base(bucket, cfg, ident, base, print).spec == spec  # a restart: the same base, the same spec
    with pytest.raises(ContractMismatch, match="adapter.base_hash"):
        publish_adapter_base(bucket, cfg, ident, {"w.weight": np.zeros((2, 64), np.float32)}, print)
