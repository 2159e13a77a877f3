"""The memory preflight's core (``stoa.config.memory``): the search both modes share, its report and refusal, and
the shared activation model; plus the trainer's checkpointing fix keeping its compute dtype."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from stoa.config import TrainerConfig
from stoa.config.memory import (
    ACT_ATTN,
    ACT_H,
    ACT_I,
    Candidate,
    MemoryPreflightError,
    activation_bytes,
    check_fit,
    refuse,
)
from stoa.models.shapes import KNOWN_SHAPES, ModelShape
from stoa.trainer.peak import Budget, estimate_peak, fit, workload


@dataclass(frozen=True)
class Est:
    total: float

    def describe(self) -> str:
        return f"{self.total:.2f} GB"


def _knobs(w: tuple[int, int]) -> list[list[Candidate[tuple[int, int]]]]:
    """Two knobs on (a, b): a halves down to 1, then b halves down to 1."""
    a, b = w
    return [[Candidate("a", f"a = {v}", (v, b)) for v in (a // 2, a // 4) if v >= 1],
            [Candidate("b", f"b = {v}", (a, v)) for v in (b // 2, b // 4) if v >= 1]]


def _check(work: tuple[int, int], gb: float):
    return check_fit(work, lambda w: Est(float(w[0] * w[1])), lambda w: gb, _knobs, source="test",
                     dead_end="nothing helps", refuse_as="model")


def test_fits_names_no_knob():
    report = _check((4, 4), 16.0)
    assert report.fits and report.fix is None and report.knob is None and report.suggested is None
    assert report.message().endswith("available 16.00 GB (test): fits")
    refuse(report, True)  # no raise


def test_first_single_setting_that_fits_in_knob_order():
    report = _check((4, 4), 8.0)  # a = 2 fits (8) before b is tried
    assert report.fix is not None and (report.knob, report.fix.flags, report.suggested) == ("a", "a = 2", (2, 4))
    assert report.fix.estimate.total == 8.0 and report.fix.available_gb == 8.0
    report = _check((4, 4), 3.0)  # no single setting: a at its strongest (1), then b's first that fits (2)
    assert report.fix is not None and report.fix.flags == "a = 1, b = 2" and report.suggested == (1, 2)
    assert report.knob == "a"


def test_nothing_fits_refuses_as_the_dead_end():
    report = _check((4, 4), 0.5)
    assert not report.fits and report.fix is None and report.knob == "model"
    assert report.message().endswith("does not fit; nothing helps")
    with pytest.raises(MemoryPreflightError) as e:
        refuse(report, True)
    assert e.value.field == "model"
    refuse(report, False)  # preflight off: no raise


def test_activation_model():
    shape = ModelShape.from_config("tiny", {"num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 128,
                                            "vocab_size": 512, "num_attention_heads": 4})
    per_layer = 2 * 10 * (ACT_H * 64 + ACT_I * 128 + ACT_ATTN * 4 * 10) * 4
    assert activation_bytes(shape, 2, 10, 4, checkpointing=False, checkpoint_blocks=6) == pytest.approx(3 * per_layer)
    ckpt = activation_bytes(shape, 2, 10, 4, checkpointing=True, checkpoint_blocks=6)
    assert ckpt == pytest.approx(3 * 2 * 10 * 64 * 4 + 3 * per_layer)  # at most every layer
    assert activation_bytes(shape, 2, 10, 4, checkpointing=True, checkpoint_blocks=1) == pytest.approx(
        3 * 2 * 10 * 64 * 4 + per_layer)


def test_trainer_checkpointing_fix_keeps_bf16():
    smol = ModelShape.from_config("smollm2-135m", KNOWN_SHAPES["smollm2-135m"])
    cfg = TrainerConfig(model="smollm2-135m", groups_per_step=4, n_samples=8, micro_batch=1, kl_beta=0.0,
                        shared_prefix=False).validate()  # packed: checkpointing keeps micro_batch 1
    base = workload(cfg, 128, 128, 1, False, bf16=True)
    ckpt = base._replace(gradient_checkpointing=True)
    report = fit(cfg, smol, base, Budget(estimate_peak(smol, ckpt).total + 0.001, "test"), max_world=1)
    assert report.fix is not None and report.fix.knob == "gradient_checkpointing"
    assert report.suggested == ckpt and report.fix.estimate == estimate_peak(smol, ckpt)


def test_halvings_are_both_modes_knob_candidates():
    from stoa.config.memory import halvings

    assert halvings(8) == [4, 2, 1]  # the trainer's micro_batch
    assert halvings(100, 16) == [50, 25, 16]  # local mode's lengths end at their floor
    assert halvings(64, 16) == [32, 16] and halvings(16, 16) == [] and halvings(1) == []
