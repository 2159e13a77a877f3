"""A LoRA trainer recomputes on the base its contract names (tiny model, local bucket): after setup its frozen base
(also its kl reference: adapters bypassed) holds exactly the published base's decoded values, on an int8g64 base a
worker's sampled logprobs are the trainer's up to float32 noise (they were 3.5e-2 apart when the trainer kept its own
base), and a trainer restarted on a model rebuilt from the bucket keeps the run's base. The same on a 4-bit (int4g64)
base, which an MLX worker holds as ``nn.QuantizedLinear(bits=4)``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stoa.bucket import open_bucket
from stoa.contract import RunContract, download_model_files
from stoa.engines.adapter import prepare_adapter
from stoa.engines.torch import TorchEngine
from stoa.layout import contract_key
from stoa.trainer.policy import BaseView
from stoa.weights.adapter import fetch_base, is_adapter_name
from stoa.weights.planes import bf16_bits_to_f32, f32_to_bf16_bits, state_from_f32, state_to_f32
from stoa.weights.sync import WeightSync
from tests.test_trainer_resume import make_cfg
from tests.trainer.test_adapter_fleet import _worst_gap

GAP_TOL = 1e-4
"""Worst |trainer - worker| logprob allowed in float32 on either base plane (measured: ~1e-6)."""


def _base_of(policy: Any) -> dict[str, np.ndarray]:
    return {k: t.detach().float().numpy() for k, t in policy.named_tensors().items() if not is_adapter_name(k)}


@pytest.fixture(scope="module", params=["int8g64", "int4g64"])
def int8_run(request: pytest.FixtureRequest, tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A float32 LoRA trainer on a quantized base (int8g64, then int4g64; the tiny model as shipped: float32
    values, not bf16) with a kl reference, that published v1 and a trained-looking v2."""
    from stoa.trainer.loop import _Trainer

    plane = request.param
    tmp = tmp_path_factory.mktemp(f"{plane}-base")
    url = str(tmp / "b")
    t = _Trainer(make_cfg(url, model=str(tiny_dir), lora_rank=4, lora_alpha=8.0, dtype="float32", plane=plane,
                          kl_beta=0.01), echo=lambda *_: None)
    t.resume()
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for k, p in t.policy.named_parameters().items():
            if is_adapter_name(k):
                bits = f32_to_bf16_bits(p.detach().numpy() + 0.05 * rng.standard_normal(p.shape).astype(np.float32))
                p.copy_(torch.from_numpy(bf16_bits_to_f32(bits)))
    t.publish(2)
    yield {"t": t, "url": url, "tmp": tmp, "plane": plane}
    t.close()


def test_the_trainers_base_is_the_published_base_bit_for_bit(int8_run: Any):
    t = int8_run["t"]
    bucket = open_bucket(int8_run["url"])
    contract = RunContract.from_json(bucket.get(contract_key("r")))
    spec = contract.adapter_spec
    assert spec is not None and contract.plane == int8_run["plane"]
    want = state_to_f32(fetch_base(bucket, "r", contract.plane, spec), contract.plane, compute=True)
    assert isinstance(t.ref, BaseView) and t.ref.policy is t.policy  # the kl reference is the policy's own base
    got = _base_of(t.policy)
    assert got.keys() == want.keys()
    assert all(np.array_equal(got[k].view(np.uint32), want[k].view(np.uint32)) for k in want)


def test_a_worker_on_a_quantized_base_scores_as_the_trainer(int8_run: Any):
    bucket = open_bucket(int8_run["url"])
    contract = RunContract.from_json(bucket.get(contract_key("r")))
    wdir = download_model_files(bucket, "r", int8_run["tmp"] / "w")
    engine = TorchEngine(wdir, device="cpu", dtype="float32")
    check = prepare_adapter(engine, "torch", bucket, contract, wdir, echo=lambda *_: None)
    sync = WeightSync(bucket, "r", contract.weight_plane, run_key=contract.run_key, check=check)
    version, state = sync.sync()
    assert version == 2
    engine.load_state(state, contract.weight_plane)
    worst = _worst_gap(engine, int8_run["t"])
    assert worst < GAP_TOL, worst


def test_a_trainer_restarted_on_the_rebuilt_base_keeps_the_runs_base(tiny_dir: Path, tmp_path: Path):
    """int8g64 does not quantize its own dequantized values back to the same bits: the base rebuilt from the
    bucket is still the run's (same hash), another base is still refused."""
    from types import SimpleNamespace

    from stoa.contract import ContractMismatch
    from stoa.models.lora_torch import LoraSpec
    from stoa.trainer.lora import Identity, publish_adapter_base

    bucket, cfg = open_bucket(str(tmp_path / "b")), SimpleNamespace(run="r", plane="int8g64")
    ident = Identity("llama:c:t", LoraSpec(4, 8.0))
    rng = np.random.default_rng(1)
    base = {"w.weight": (0.05 * rng.standard_normal((8, 128))).astype(np.float32)}
    first = publish_adapter_base(bucket, cfg, ident, base, print)
    rebuilt = state_to_f32(state_from_f32(base, "int8g64"), "int8g64")  # what model_from_bucket writes
    requantized, published = state_from_f32(rebuilt, "int8g64"), state_from_f32(base, "int8g64")
    assert not np.array_equal(requantized["w.weight"], published["w.weight"])  # so the hash alone would refuse it
    again = publish_adapter_base(bucket, cfg, ident, rebuilt, print)
    assert again.spec == first.spec
    assert all(np.array_equal(again.values[k], first.values[k]) for k in first.values)
    other = {"w.weight": first.values["w.weight"] + np.float32(1.0)}
    with pytest.raises(ContractMismatch, match="adapter.base_hash"):
        publish_adapter_base(bucket, cfg, ident, other, print)


def test_an_mlx_worker_on_a_quantized_base_scores_as_the_trainer(int8_run: Any):
    pytest.importorskip("mlx.core", reason="needs mlx (mlx[cpu] on Linux)")
    from stoa.engines.mlx.engine import MLXEngine

    bucket = open_bucket(int8_run["url"])
    contract = RunContract.from_json(bucket.get(contract_key("r")))
    wdir = download_model_files(bucket, "r", int8_run["tmp"] / "m")
    engine = MLXEngine(wdir, dtype="float32")
    check = prepare_adapter(engine, "mlx", bucket, contract, wdir, echo=lambda *_: None)
    sync = WeightSync(bucket, "r", contract.weight_plane, run_key=contract.run_key, check=check)
    engine.load_state(sync.sync()[1], contract.weight_plane)
    worst = _worst_gap(engine, int8_run["t"])
    assert worst < GAP_TOL, worst


def test_an_mlx_worker_holds_a_4bit_base_as_quantized_layers(int8_run: Any):
    pytest.importorskip("mlx.core", reason="needs mlx (mlx[cpu] on Linux)")
    import mlx.nn as nn

    from stoa.engines.mlx.engine import MLXEngine

    if int8_run["plane"] != "int4g64":
        pytest.skip("checks the int4g64 base only")
    bucket = open_bucket(int8_run["url"])
    contract = RunContract.from_json(bucket.get(contract_key("r")))
    wdir = download_model_files(bucket, "r", int8_run["tmp"] / "m4")
    engine = MLXEngine(wdir, dtype="float32")
    prepare_adapter(engine, "mlx", bucket, contract, wdir, echo=lambda *_: None)
    quantized = [m for _, m in engine.model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert quantized and all(m.bits == 4 and m.group_size == 64 for m in quantized)


def test_a_4bit_plane_is_a_lora_base_only(tmp_path: Path):
    from stoa.config.base import ConfigError

    with pytest.raises(ConfigError, match="lora_rank"):
        make_cfg(str(tmp_path / "b"), plane="int4g64")
    data = _int4_contract(tmp_path)
    assert RunContract.from_json(data).plane == "int4g64"
    full = json.loads(data)
    del full["adapter"]  # a full fine-tuning contract on a 4-bit plane
    with pytest.raises(ValueError, match="int4g64"):
        RunContract.from_json(json.dumps(full).encode())


def _int4_contract(tmp_path: Path) -> bytes:
    from stoa.trainer.loop import _Trainer

    url = str(tmp_path / "b")
    t = _Trainer(make_cfg(url, lora_rank=2, lora_alpha=4.0, plane="int4g64"), echo=lambda *_: None)
    t.close()
    return open_bucket(url).get(contract_key("r"))
