"""The trainer's memory preflight: the estimate's arithmetic, the knob a refusal names, the dry run's breakdown,
and the torchrun command of ``--nproc``."""

from __future__ import annotations

import dataclasses

import pytest

from stoa.cli.trainer import memory_report, torchrun_argv, world_size
from stoa.config import TrainerConfig
from stoa.config import memory as core
from stoa.config.memory import MemoryPreflightError
from stoa.models.shapes import KNOWN_SHAPES, ModelShape
from stoa.trainer import peak as memory
from stoa.trainer.peak import Budget, Workload, estimate_peak, fit, preflight, workload

GB = 1e9
TINY = ModelShape.from_config("tiny", {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                                       "vocab_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
                                       "tie_word_embeddings": True})
SMOL = ModelShape.from_config("smollm2-135m", KNOWN_SHAPES["smollm2-135m"])
# by hand: q 64x64, k and v 64x32, o 64x64, gate/up/down 64x128 -> 36864, plus two norms of 64 per block
TINY_BLOCK = 4096 + 2048 + 2048 + 4096 + 3 * 8192 + 2 * 64
TINY_PARAMS = 512 * 64 + 2 * TINY_BLOCK + 64  # tied embedding, two blocks, final norm: 106816 (the built model's)


def test_parameter_count_is_exact():
    assert TINY.params() == TINY_PARAMS == 106816


def test_states_are_fp32_and_shard_over_ranks():
    one = estimate_peak(TINY, Workload(4, 10, 6, False, False))
    four = estimate_peak(TINY, Workload(4, 10, 6, False, False, world_size=4))
    assert one.parameters == pytest.approx(TINY_PARAMS * 4 / GB)  # CPU, one rank: the master weights only
    assert (one.gradients, one.optimizer) == pytest.approx((TINY_PARAMS * 4 / GB, TINY_PARAMS * 8 / GB))
    assert (four.gradients, four.optimizer) == pytest.approx((one.gradients / 4, one.optimizer / 4))
    gathered = (512 * 64 + 64 + 2 * TINY_BLOCK) * 4  # root (embedding, norm) + the block and the prefetched one
    assert four.parameters == pytest.approx((TINY_PARAMS * 4 / 4 + gathered) / GB)
    assert four.activations == one.activations and four.logits == one.logits


def test_bf16_compute_shrinks_activations_and_halves_the_reference():
    fp32 = estimate_peak(TINY, Workload(4, 10, 6, False, True))
    bf16 = estimate_peak(TINY, Workload(4, 10, 6, False, True, bf16=True))
    assert bf16.parameters == pytest.approx(fp32.parameters * 1.5)  # autocast's bf16 copy next to the fp32 master
    assert bf16.activations == pytest.approx(fp32.activations * 3 / 4)  # autocast keeps fp32 inputs too
    sharded = estimate_peak(TINY, Workload(4, 10, 6, False, True, world_size=2, bf16=True))
    assert sharded.activations == pytest.approx(fp32.activations / 2)
    assert bf16.reference == pytest.approx(fp32.reference / 2)  # stored in bf16: no master weights to keep
    kept = 4 * 6 * 512  # the micro-batch's logits, kept for backward in the compute dtype
    assert bf16.logits == pytest.approx(fp32.logits - kept * 2 / GB)  # the loss stays fp32; kept in bf16


def test_logits_are_bounded_by_the_chunk():
    from stoa.engines.torch_scoring import LOGITS_CHUNK_ELEMENTS

    big = estimate_peak(SMOL, Workload(16, 48, 64, False, False))
    assert big.logits == pytest.approx(LOGITS_CHUNK_ELEMENTS * 4 * memory.LOGIT_COPIES / GB)


def test_activations_and_logits_by_hand():
    b, s, t = 4, 16, 6
    est = estimate_peak(TINY, Workload(b, s - t, t, False, False))
    per_layer = b * s * (core.ACT_H * 64 + core.ACT_I * 128 + core.ACT_ATTN * 4 * s) * 4
    assert est.activations == pytest.approx(2 * per_layer * memory.ACT_SCALE / GB)
    # completion positions only: two fp32 buffers while scoring, and the logits kept for backward
    assert est.logits == pytest.approx(b * t * 512 * 4 * (memory.LOGIT_COPIES + 1) / GB)
    ckpt = estimate_peak(TINY, Workload(b, s - t, t, True, False))
    layers = min(memory.CKPT_LAYERS, 2)  # the tiny model has 2
    assert ckpt.activations == pytest.approx((2 * b * s * 64 * 4 + layers * per_layer) * memory.ACT_SCALE / GB)
    big = Workload(16, 256, 256, False, False)
    assert estimate_peak(SMOL, big._replace(gradient_checkpointing=True)).activations < \
        estimate_peak(SMOL, big).activations / 4


def test_kl_adds_the_sharded_reference():
    base = Workload(4, 10, 6, False, False, world_size=2)
    off, on = estimate_peak(TINY, base), estimate_peak(TINY, base._replace(reference=True))
    assert off.reference == 0 and on.reference == pytest.approx(TINY_PARAMS * 4 / 2 / GB)
    assert on.total == pytest.approx(off.total + on.reference)


def _cfg(**kw) -> TrainerConfig:
    base = {"model": "smollm2-135m", "groups_per_step": 4, "n_samples": 8, "micro_batch": 16, "kl_beta": 0.04,
            "shared_prefix": False}  # packed: micro_batch is a knob
    return TrainerConfig(**{**base, **kw}).validate()


def _fix(cfg: TrainerConfig, gb: float, *, world: int = 1, max_world: int = 1, cuda: bool = False):
    base = workload(cfg, 128, 128, world, cuda)
    return fit(cfg, SMOL, base, Budget(gb, "test"), max_world=max_world)


def _total(cfg: TrainerConfig, **changes) -> float:
    return estimate_peak(SMOL, workload(cfg, 128, 128, 1, False)._replace(**changes)).total


def test_refusal_names_the_largest_micro_batch_that_fits():
    cfg = _cfg()
    budget = (_total(cfg, micro_batch=4) + _total(cfg, micro_batch=8)) / 2
    report = _fix(cfg, budget)
    assert not report.fits and report.fix is not None
    assert (report.fix.knob, report.fix.flags) == ("micro_batch", "--micro-batch 4")
    with pytest.raises(MemoryPreflightError) as e:
        preflight(cfg, report)
    assert e.value.field == "micro_batch" and "--micro-batch 4" in str(e.value)


def test_the_shared_prefix_default_sizes_one_group_and_refuses_with_checkpointing():
    cfg = TrainerConfig(model="smollm2-135m", groups_per_step=4, n_samples=8, micro_batch=16).validate()
    assert cfg.shared_prefix  # the default: one group of n_samples rows per pass, whatever micro_batch says
    assert workload(cfg, 128, 128, 1, False).micro_batch == 8
    report = _fix(cfg, _total(cfg, gradient_checkpointing=True, micro_batch=16) + 0.01)
    assert report.fix is not None and report.fix.knob == "gradient_checkpointing"  # no smaller micro-batch to offer


def test_refusal_prefers_checkpointing_then_ranks_then_kl():
    cfg = _cfg(micro_batch=1)  # no smaller micro-batch
    ckpt = _total(cfg, gradient_checkpointing=True)
    assert _fix(cfg, ckpt + 0.01).fix.knob == "gradient_checkpointing"  # type: ignore[union-attr]
    cfg = _cfg(micro_batch=1, gradient_checkpointing=True)
    w1 = estimate_peak(SMOL, workload(cfg, 128, 128, 1, True))
    w2 = estimate_peak(SMOL, workload(cfg, 128, 128, 2, True))
    report = _fix(cfg, (w1.total + w2.total) / 2, max_world=8, cuda=True)
    assert report.fix is not None and report.fix.flags == "--nproc 2"
    report = _fix(cfg, _total(cfg, reference=False) + 0.01)
    assert report.fix is not None and report.fix.flags == "--kl-beta 0"


def test_cpu_ranks_share_the_ram():
    budget = Budget(16.0, "RAM", shared_by=4)
    assert budget.per_rank(4) == 4.0 and Budget(16.0, "override").per_rank(4) == 16.0


def test_nothing_fits_names_preflight_and_off_only_reports():
    cfg = _cfg()
    report = _fix(cfg, 0.1)
    assert report.fix is None
    with pytest.raises(MemoryPreflightError) as e:
        preflight(cfg, report)
    assert e.value.field == "preflight"
    preflight(dataclasses.replace(cfg, preflight=False), report)  # no raise


def test_dry_run_breakdown_for_nproc_ranks(stoa_cache, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = TrainerConfig(model="tiny", device="cpu", available_memory_gb=64.0, kl_beta=0.0).validate()
    report = memory_report(cfg, 4, 0, offline=True)
    assert report is not None and report.fits
    assert report.work.world_size == 4 and report.work.completion_tokens == cfg.max_new_tokens
    assert 10 < report.work.prompt_tokens < 200  # the arithmetic task's held-out prompts, rendered
    assert report.estimate.gradients == pytest.approx(TINY_PARAMS * 4 / 4 / GB)
    assert report.available_gb == 64.0
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert memory_report(cfg, 0, 77, offline=True).work[:3] == (cfg.n_samples, 77, cfg.max_new_tokens)  # type: ignore  # one group per pass
    assert world_size(0, {"WORLD_SIZE": "2"}) == 2 and world_size(3, {"WORLD_SIZE": "2"}) == 3


def test_cli_refuses_with_exit_2(stoa_cache, tmp_path, monkeypatch, capsys):
    from stoa.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("os.execvp", lambda *a: pytest.fail("a dry run never execs"))
    new = ["--run", "r", "--model", "tiny"]
    assert main(["trainer", "--dry-run", *new, "--device", "cpu", "--nproc", "2", "--available-memory-gb", "64"]) == 0
    assert main(["trainer", "--dry-run", *new, "--device", "cpu", "--available-memory-gb", "0.01"]) == 2
    assert "does not fit" in capsys.readouterr().err


def test_torchrun_argv_drops_nproc():
    argv = ["--debug", "trainer", "--nproc", "4", "--run", "r", "--nproc=4", "--micro-batch", "2"]
    cmd = torchrun_argv(argv, 4, "/py")
    assert cmd == ["/py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m", "stoa",
                   "--", "--debug", "trainer", "--run", "r", "--micro-batch", "2"]
    from torch.distributed.run import parse_args

    parsed = parse_args(cmd[3:])  # torchrun's own parser must not take --run for its --run-path
    assert parsed.training_script == "stoa" and parsed.module and parsed.nproc_per_node == "4"
    assert parsed.training_script_args == ["--debug", "trainer", "--run", "r", "--micro-batch", "2"]


def test_a_moe_block_is_gathered_with_every_expert_and_runs_only_its_top_k(stoa_cache):
    import json

    from stoa.models import resolve_model

    cfg = json.loads((resolve_model("tiny-qwen3-moe", cache_dir=stoa_cache) / "config.json").read_text())
    base = ModelShape.from_config("moe", cfg)
    more = ModelShape.from_config("moe", {**cfg, "num_experts": 2 * cfg["num_experts"]})
    wider = ModelShape.from_config("moe", {**cfg, "num_experts_per_tok": cfg["num_experts_per_tok"] + 1})
    work = Workload(4, 10, 6, False, False, world_size=2, bf16=True)
    a, b, c = (estimate_peak(s, work) for s in (base, more, wider))
    assert b.parameters > a.parameters and b.activations == a.activations  # idle experts are held, not run
    assert c.activations > a.activations and c.parameters == a.parameters


def test_a_bf16_compute_copy_halves_activations_and_keeps_its_weights():
    """The copy computes every activation in bf16 (2 bytes against autocast's 3); its 2 bytes per parameter are
    autocast's kept casts made permanent. A LoRA run and a sharded one autocast whatever the setting."""
    auto = estimate_peak(TINY, Workload(4, 10, 6, False, True, bf16=True))
    copy = estimate_peak(TINY, Workload(4, 10, 6, False, True, bf16=True, bf16_copy=True))
    assert copy.activations == pytest.approx(auto.activations * 2 / 3)
    assert copy.parameters == auto.parameters and copy.gradients == auto.gradients
    assert copy.optimizer == auto.optimizer and copy.logits == auto.logits
    lora = Workload(4, 10, 6, False, True, bf16=True, lora_rank=2, lora_targets=("q_proj",))
    assert estimate_peak(TINY, lora._replace(bf16_copy=True)) == estimate_peak(TINY, lora)
    cfg = TrainerConfig(model="tiny", device="cpu", kl_beta=0.0).validate()
    assert cfg.compute_weights == "bf16_copy" and workload(cfg, 10, 6, 1, False, bf16=True).bf16_copy
    assert not workload(cfg, 10, 6, 1, False, bf16=False).bf16_copy
    auto_cfg = TrainerConfig(model="tiny", device="cpu", kl_beta=0.0, compute_weights="autocast").validate()
    assert not workload(auto_cfg, 10, 6, 1, False, bf16=True).bf16_copy


def test_lean_activations_drop_the_norms_fp32_intermediates_and_the_swiglu_activation():
    """Per token and layer, lean activations keep 8 bytes per hidden value (two norms' fp32 intermediates) and one
    MLP activation in the compute dtype less; only one rank without gradient checkpointing runs them."""
    for bf16, cb in ((False, 4), (True, 2)):
        plain = Workload(4, 10, 6, False, False, bf16=bf16, bf16_copy=bf16)
        lean = estimate_peak(TINY, plain._replace(lean=True))
        saved = 4 * 16 * TINY.layers * (8 * TINY.hidden + cb * TINY.intermediate) * memory.ACT_SCALE
        assert (estimate_peak(TINY, plain).activations - lean.activations) * GB == pytest.approx(saved)
        ckpt = plain._replace(gradient_checkpointing=True)
        assert estimate_peak(TINY, ckpt._replace(lean=True)) == estimate_peak(TINY, ckpt)
    cfg = TrainerConfig(model="tiny", device="cpu", kl_beta=0.0).validate()
    assert workload(cfg, 10, 6, 1, False).lean and not workload(cfg, 10, 6, 2, False).lean
    assert not workload(dataclasses.replace(cfg, gradient_checkpointing=True), 10, 6, 1, False).lean
