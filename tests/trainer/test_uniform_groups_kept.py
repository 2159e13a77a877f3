"""The trainer keeps groups of equal rewards for GiGPO and for ECHO with any algorithm, even with
``skip_uniform_groups = true``: GiGPO's step advantages and ECHO's echo term carry signal there. Plain GRPO
skips them. Driven through the trainer's own loop and record pool, with the optimizer step faked."""

from __future__ import annotations

import time

import numpy as np
import pytest

from stoa.config import TrainerConfig
from stoa.layout import rollout_key
from stoa.rollouts.records import RolloutRecord, Sample

UNIFORM, MIXED = ("aaa", "aaa"), ("aaa", "xyz")  # the toy task rewards these equally / unequally


def _cfg(bucket: str, **kw) -> TrainerConfig:
    base = dict(bucket=bucket, run="r", model="tiny", task="toy", n_samples=2, eval_n=0, kl_beta=0.0, steps=1,
                anchor_every=100, groups_per_step=2, staleness_bound=1, poll_seconds=0.01, metrics_flush_rows=1,
                log_dir="", skip_uniform_groups=True, max_wait_seconds=3)
    return TrainerConfig(**{**base, **kw}).validate()


def _put(t, seq: int, text: tuple[str, str]) -> None:
    """A version-1 record of the toy prompt train:1 with the two completions ``text``."""
    prompt = t.task.get("train:1")
    samples = []
    for s in text:
        toks = np.array(t.codec.tok.encode(s, add_special_tokens=False), np.int32)
        samples.append(Sample(toks, np.full(toks.size, -1.0 - seq / 64, np.float32), t.task.reward(prompt, s),
                              "length"))
    rec = RolloutRecord("w", seq, 1, t.contract.fingerprint(), "toy", "train:1",
                        np.array(t.codec.encode_prompt(prompt.messages), np.int32), samples)
    t.bucket.put_create(rollout_key("r", 1, "w", seq), rec.encode())


@pytest.mark.parametrize(("algorithm", "algo", "keeps"), [
    ("grpo", {"echo_alpha": 0.1}, True),  # ECHO with a non-GiGPO algorithm
    ("rloo", {"echo_alpha": 0.05}, True),
    ("gigpo", {}, True),
    ("grpo", {}, False),  # the control: without ECHO or GiGPO they are skipped
])
def test_uniform_groups_reach_the_step_when_their_algorithm_trains_on_them(tmp_path, stoa_cache, algorithm, algo,
                                                                          keeps):
    from stoa.trainer.loop import _Trainer

    t = _Trainer(_cfg(str(tmp_path / "b"), algorithm=algorithm, algo=algo), echo=lambda *_: None)
    for seq, text in enumerate((UNIFORM, UNIFORM, MIXED, MIXED)):  # the uniform ones sort first
        _put(t, seq, text)
    trained: list[list[float]] = []

    def train(entries) -> None:
        trained.extend(list(map(float, e.rewards)) for e in entries)
        t.step += 1
        t.version += 1
        t.publish(t.version)

    t.train = train
    t0 = time.monotonic()
    try:
        t.run()
    finally:
        t.close()
    assert time.monotonic() - t0 < 30
    uniform = [r for r in trained if len(set(r)) == 1]
    assert len(trained) == 2
    assert len(uniform) == (2 if keeps else 0), trained
