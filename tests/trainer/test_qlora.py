"""A LoRA trainer on a quantized base (``lora_base_plane``; tiny model, fp32, CPU): its decoder linears hold the
weights plane's bits exactly (so its dequantized base is a worker's), it trains the adapter alone and lowers the
loss, a fleet trainer publishes those bits and recomputes on them, a checkpoint of one base plane refuses the
other, the setting is refused without LoRA, and the preflight counts the base at 4 or 8 bits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stoa.bucket import open_bucket
from stoa.config import ConfigError, TrainerConfig
from stoa.episodes.demo_rows import SftRow
from stoa.models.lora_torch import DEFAULT_TARGETS, LoraSpec, is_adapter
from stoa.models.quant_torch import QuantLinear, quant_linears
from stoa.rollouts.episode import ROLE_ACTION
from stoa.trainer import checkpoint as ckpt
from stoa.trainer.coldstart import sft_steps
from stoa.trainer.lora import Identity, PublishedBase, base_fingerprint, identity_problem
from stoa.trainer.policy import Policy
from stoa.weights.planes import QUANT_BITS, state_from_f32, state_to_f32

CPU = torch.device("cpu")
SPEC = LoraSpec(4, 8.0)
PLANES = ("int8g64", "int4g64")


def _float_linears(tiny_dir: Path) -> dict[str, np.ndarray]:
    """The decoder linears' weights as the model ships them (float32)."""
    pol = Policy(tiny_dir, CPU, lora=SPEC)
    return {k: t.detach().numpy().copy() for k, t in pol.named_tensors().items()
            if ".layers." in k and k.endswith("proj.weight")}


@pytest.mark.parametrize("plane", PLANES)
def test_the_quantized_base_is_the_weights_planes_bits_and_values(tiny_dir: Path, plane: str):
    weights = _float_linears(tiny_dir)
    want = state_from_f32(weights, plane)
    pol = Policy(tiny_dir, CPU, lora=SPEC, base_plane=plane)
    quant = quant_linears(pol.model)
    assert {f"{p}.weight" for p in quant} == set(weights)  # every decoder linear of the tiny model (in % 64 == 0)
    got = pol.base_plane_bits()
    assert got.keys() == want.keys()
    assert all(got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]) for k in want)
    values = state_to_f32(want, plane, compute=True)
    for path, q in quant.items():
        assert q.bits == QUANT_BITS[plane]
        assert np.array_equal(q.dequantized().numpy().view(np.uint32), values[f"{path}.weight"].view(np.uint32))


def _rows(n: int = 4) -> list[SftRow]:
    rng = np.random.default_rng(3)
    return [SftRow(rng.integers(3, 500, 6).astype(np.int32), rng.integers(3, 500, 8).astype(np.int32),
                   np.full(8, ROLE_ACTION, np.int8)) for _ in range(n)]


def test_a_4bit_base_lora_step_lowers_the_loss_and_moves_only_the_adapter(tiny_dir: Path):
    pol = Policy(tiny_dir, CPU, lora=SPEC, base_plane="int4g64")
    quant = quant_linears(pol.model)
    assert all(isinstance(m, QuantLinear) and "lora_scale" in m.__dict__ for p, m in quant.items()
               if p.endswith(DEFAULT_TARGETS))  # the adapters wrap the quantized linears
    frozen = {k: t.clone() for k, t in pol.model.state_dict().items() if not is_adapter(k)}
    adapter = {k: p.detach().clone() for k, p in pol.model.named_parameters() if is_adapter(k)}
    assert {k for k, p in pol.model.named_parameters() if p.requires_grad} == set(adapter)
    steps = sft_steps(pol, _rows(), steps=3, batch=4, micro_batch=4, lr=1e-2, grad_clip=1.0, seed=0)
    assert steps[-1].loss < steps[0].loss - 0.05
    after = pol.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in frozen.items())  # codes, scales, norms: bit-identical
    assert all(not torch.equal(after[k], v) for k, v in adapter.items())


def test_a_fleet_trainer_publishes_its_4bit_base_and_recomputes_on_it(tiny_dir: Path, tmp_path: Path):
    from stoa.contract import RunContract
    from stoa.layout import contract_key
    from stoa.trainer.loop import _Trainer
    from stoa.weights.adapter import fetch_base
    from tests.test_trainer_resume import make_cfg

    cfg = make_cfg(str(tmp_path / "b"), model=str(tiny_dir), lora_rank=4, lora_alpha=8.0, dtype="float32",
                   plane="int4g64", lora_base_plane="int4g64")
    t = _Trainer(cfg, echo=lambda *_: None)
    try:
        own = t.policy.base_plane_bits()
        t.resume()
        bucket = open_bucket(cfg.bucket)
        contract = RunContract.from_json(bucket.get(contract_key("r")))
        assert contract.plane == "int4g64" and contract.adapter_spec is not None
        state = fetch_base(bucket, "r", contract.plane, contract.adapter_spec)
        assert all(np.array_equal(state[k], v) for k, v in own.items())  # published as the trainer holds it
        q = next(iter(quant_linears(t.policy.model).values()))
        with torch.no_grad():
            q.codes.zero_()
            q.scales.zero_()
        t.ops.load_base(PublishedBase(contract.adapter_spec, state, state_to_f32(state, "int4g64", compute=True)))
        again = t.policy.base_plane_bits()  # a trainer computes on the published bits
        assert all(np.array_equal(again[k], v) for k, v in own.items())
        t.ops.save(1, 0)
    finally:
        t.close()
    t2 = _Trainer(cfg, echo=lambda *_: None)  # a restart quantizes to the same bits: the run's base, accepted
    try:
        t2.resume()
        assert t2.version == 1 and t2.policy.base_plane_bits().keys() == own.keys()
    finally:
        t2.close()
    with pytest.raises((SystemExit, ValueError), match="lora_base_plane"):
        t3 = _Trainer(make_cfg(cfg.bucket, model=str(tiny_dir), lora_rank=4, lora_alpha=8.0, dtype="float32",
                               plane="int4g64"), echo=lambda *_: None)
        try:
            t3.resume()
        finally:
            t3.close()


def test_a_checkpoint_of_one_base_plane_refuses_the_other(tiny_dir: Path, tmp_path: Path):
    bucket = open_bucket(str(tmp_path / "b"))
    four = Identity(base_fingerprint(tiny_dir), SPEC, "tiny", "int4g64")
    full = Identity(four.base, SPEC, "tiny")
    pol = Policy(tiny_dir, CPU, lora=SPEC, base_plane="int4g64")
    opt = torch.optim.AdamW(pol.trainable_parameters())
    ckpt.save_checkpoint(bucket, "r", pol.model, opt, version=1, step=0, echo=lambda s: None, identity=four)
    with pytest.raises(ckpt.CheckpointError, match="held int4g64 but .* set lora_base_plane = 'int4g64'"):
        ckpt.load_checkpoint(bucket, "r", pol.model, opt, echo=lambda s: None, identity=full)
    assert ckpt.load_checkpoint(bucket, "r", pol.model, opt, echo=lambda s: None, identity=four) is not None
    why = identity_problem(full.adapter, full.base, four)
    assert why is not None and "held at the compute dtype but" in why and "lora_base_plane = ''" in why
    assert identity_problem(four.adapter, four.base, Identity(four.base, SPEC, "tiny", "int8g64")) is not None


@pytest.mark.parametrize(("kw", "needle"), [
    ({"lora_base_plane": "int8g64", "plane": "int8g64"}, "set lora_rank > 0"),
    ({"lora_base_plane": "int4g64", "lora_rank": 4}, "set plane = int4g64"),
    ({"lora_base_plane": "nf4", "lora_rank": 4}, "use int8g64, int4g64"),
])
def test_a_quantized_base_without_lora_or_on_another_plane_is_refused(kw: dict, needle: str):
    with pytest.raises(ConfigError) as e:
        TrainerConfig(**kw).validate()
    assert e.value.field == "lora_base_plane" and needle in str(e.value) and "\n" not in str(e.value)
    assert TrainerConfig(lora_rank=4, plane="int4g64", lora_base_plane="int4g64").validate().lora_base_plane


def test_the_preflight_counts_a_4bit_base():
    from stoa.config.memory import lora_params
    from stoa.models.shapes import shape_for
    from stoa.trainer.peak import estimate_peak, workload

    shape = shape_for("smollm2-135m")
    assert shape is not None
    cfg = TrainerConfig(lora_rank=16, n_samples=8, groups_per_step=2, plane="int4g64").validate()
    bf16 = estimate_peak(shape, workload(cfg, 48, 64, 1, False, True))
    q = TrainerConfig(lora_rank=16, n_samples=8, groups_per_step=2, plane="int4g64", lora_base_plane="int4g64")
    work = workload(q.validate(), 48, 64, 1, False, True)
    assert work.lora_base_bits == 4
    four = estimate_peak(shape, work)
    linears = 30 * (576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536)  # q, o; k, v; gate, up, down
    adapter = lora_params(shape, 16, DEFAULT_TARGETS) * 4
    want = linears * (0.5 + 4 / 64) + (shape.params() - linears) * 2 + adapter
    assert four.parameters == pytest.approx(want / 1e9)
    assert bf16.parameters - four.parameters == pytest.approx(linears * (2 - 0.5 - 4 / 64) / 1e9)


def test_gradients_flow_through_a_quantized_linear_as_through_its_values():
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 8)
    q = QuantLinear(lin, 4, 64, packed=True, bf16=True)
    x = torch.randn(3, 128, requires_grad=True)
    (q(x) ** 2).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    (torch.nn.functional.linear(x2, q.dequantized(), q.bias) ** 2).sum().backward()
    assert x.grad is not None and x2.grad is not None and torch.allclose(x.grad, x2.grad, atol=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_bf16_quantized_linear_holds_the_planes_bits_for_float32_weights(bits: int):
    from stoa.weights.planes import dequantize_int8g64, quantize_int8g64

    torch.manual_seed(bits)
    lin = torch.nn.Linear(256, 48, bias=False)
    with torch.no_grad():
        lin.weight[0, :64] = 0.0  # an all-zero group, and groups whose edge is the minimum or the maximum
        lin.weight[1] *= 1e-6
        lin.weight[2, 64:128] = torch.linspace(-3.0, 0.5, 64)
    q = QuantLinear(lin, bits, 64, packed=True, bf16=True)
    want = quantize_int8g64(lin.weight.detach().numpy(), bits)
    assert all(np.array_equal(g, w) for g, w in zip(q.plane_bits(), want, strict=True))
    values = dequantize_int8g64(*want, compute=True, bits=bits)
    assert np.array_equal(q.dequantized().numpy().view(np.uint32), values.view(np.uint32))
