"""Logprob agreement on a LoRA run's adapter plane per base plane, trainer compute dtype, worker engine and worker
dtype, on the tiny model (figures in docs/weights.md#adapter-plane-lora-runs): the worst |trainer - worker| gap and
the quarantine's statistics (``exp|d| - 1``: the median over the batch's tokens, judged against
``quarantine_disagreement``, and the largest record median, the CUSUM's score, against ``quarantine_drift``).

A real ``_Trainer`` (tiny model rounded to bf16 values, LoRA r 4, a trained-looking adapter of bf16 values)
publishes v2 into a temporary local bucket; each worker sets its engine up from the bucket alone
(``prepare_adapter``), syncs the adapter and samples 4 x 4 completions of 16 tokens (temperature 1); the trainer
scores them with its sampling forward (``Policy.sampling``). ``--own-base`` puts the trainer's base back to the
model's own weights (the trainer before it recomputed on the published base).

    python benchmarks/adapter_gap.py [--own-base]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

from stoa.bucket import open_bucket
from stoa.config import TrainerConfig
from stoa.contract import RunContract, download_model_files
from stoa.engines import make_engine
from stoa.engines.adapter import prepare_adapter
from stoa.layout import contract_key
from stoa.models import resolve_model
from stoa.weights.adapter import is_adapter_name
from stoa.weights.planes import bf16_bits_to_f32, f32_to_bf16_bits
from stoa.weights.sync import WeightSync

PROMPTS = [[5, 17, 42, 9], [7, 7, 100, 3, 250], [11, 300, 2, 64], [400, 8, 9, 10, 31, 77]]


def _bf16(x: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(f32_to_bf16_bits(x))


@dataclass(frozen=True)
class Gap:
    """One worker's agreement with the trainer on its sampled tokens."""

    worst: float
    """Largest |trainer - worker| logprob."""
    median: float
    """Median ``exp|d| - 1`` over every token (the lag-0 disagreement statistic)."""
    record_max: float
    """Largest per-record median ``exp|d| - 1`` (the sequential test's record score)."""


def measure(engine: Any, policy: Any) -> Gap:
    """The gaps over 4 x 4 sampled completions of 16 tokens."""
    groups, _ = engine.generate(PROMPTS, 4, max_new_tokens=16, generator=engine.make_generator(0))
    diffs: list[np.ndarray] = []
    with torch.no_grad(), policy.sampling():
        for prompt, group in zip(PROMPTS, groups, strict=True):
            comps = [np.array(c.tokens) for c in group]
            logp = policy.group_logprobs(np.array(prompt), comps, max(len(c) for c in comps)).float().numpy()
            diffs += [np.abs(row[: len(c.tokens)] - np.array(c.logprobs)) for row, c in zip(logp, group, strict=True)]
    every = np.expm1(np.concatenate(diffs))
    return Gap(float(max(d.max() for d in diffs)), float(np.median(every)),
               float(max(np.median(np.expm1(d)) for d in diffs)))


def _trainer(tmp: Path, model: Path, plane: str, dtype: str, own_base: bool) -> Any:
    from stoa.trainer.loop import _Trainer

    cfg = TrainerConfig(bucket=str(tmp / f"b-{plane}-{dtype}"), run="r", model=str(model), task="toy", n_samples=2,
                        eval_n=0, kl_beta=0.0, lora_rank=4, lora_alpha=8.0, dtype=dtype, plane=plane).validate()
    t = _Trainer(cfg, echo=lambda *_: None)
    if own_base:  # back to the model's own weights: the trainer before it recomputed on the published base
        w = load_file(str(model / "model.safetensors"))
        t.ranks("load_base", main_only={k: w[k] for k in t.policy.named_tensors() if not is_adapter_name(k)})
    t.resume()
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for k, p in t.policy.named_parameters().items():
            if is_adapter_name(k):
                noise = 0.05 * rng.standard_normal(p.shape).astype(np.float32)
                p.copy_(torch.from_numpy(_bf16(p.detach().float().numpy() + noise)))
    t.publish(2)
    return t


def main() -> None:
    own_base = "--own-base" in sys.argv[1:]
    tmp = Path(tempfile.mkdtemp(prefix="stoa-adapter-gap-"))
    try:
        model = tmp / "base"
        shutil.copytree(resolve_model("tiny"), model)
        w = load_file(str(model / "model.safetensors"))
        save_file({k: _bf16(v) for k, v in w.items()}, str(model / "model.safetensors"), metadata={"format": "pt"})
        for plane in ("bf16", "int8g64", "int4g64"):
            for tdtype in ("float32", "bfloat16"):
                t = _trainer(tmp, model, plane, tdtype, own_base)
                bucket = open_bucket(t.cfg.bucket)
                contract = RunContract.from_json(bucket.get(contract_key("r")))
                for eng in ("torch", "mlx"):
                    for edtype in ("float32", "bfloat16"):
                        wdir = download_model_files(bucket, "r", tmp / f"w-{plane}-{tdtype}-{eng}-{edtype}")
                        engine = make_engine(eng, wdir, dtype=edtype, device="cpu")
                        check = prepare_adapter(engine, eng, bucket, contract, wdir, echo=lambda *_: None)
                        sync = WeightSync(bucket, "r", contract.weight_plane, run_key=contract.run_key, check=check)
                        engine.load_state(sync.sync()[1], contract.weight_plane)
                        g = measure(engine, t.policy)
                        print(f"base {plane:8s} trainer {tdtype:9s} worker {eng:5s} {edtype:9s} worst gap "
                              f"{g.worst:.2e} median exp|d|-1 {g.median:.2e} max record median {g.record_max:.2e}",
                              flush=True)
                t.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
