"""Logprob agreement on a LoRA run's adapter plane: the worst |trainer - worker| gap per base plane, trainer compute
dtype, worker engine and worker dtype, on the tiny model (figures in docs/weights.md#adapter-plane-lora-runs).

A real ``_Trainer`` (tiny model rounded to bf16 values, LoRA r 4, a trained-looking adapter of bf16 values)
publishes v2 into a temporary local bucket; each worker sets its engine up from the bucket alone
(``prepare_adapter``), syncs the adapter and samples 2 x 2 completions of 6 tokens; the trainer scores them with
its sampling forward (``Policy.sampling``).

    python benchmarks/adapter_gap.py
"""

from __future__ import annotations

import shutil
import tempfile
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

PROMPTS = [[5, 17, 42, 9], [7, 7, 100, 3, 250]]


def _bf16(x: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(f32_to_bf16_bits(x))


def worst_gap(engine: Any, policy: Any) -> float:
    """The largest |trainer - worker| logprob over 2 x 2 sampled completions of 6 tokens."""
    groups, _ = engine.generate(PROMPTS, 2, max_new_tokens=6, generator=engine.make_generator(0))
    worst = 0.0
    with torch.no_grad(), policy.sampling():
        for prompt, group in zip(PROMPTS, groups, strict=True):
            comps = [np.array(c.tokens) for c in group]
            logp = policy.group_logprobs(np.array(prompt), comps, max(len(c) for c in comps)).float().numpy()
            for row, c in zip(logp, group, strict=True):
                worst = max(worst, float(np.abs(row[: len(c.tokens)] - np.array(c.logprobs)).max()))
    return worst


def _trainer(tmp: Path, model: Path, plane: str, dtype: str) -> Any:
    from stoa.trainer.loop import _Trainer

    cfg = TrainerConfig(bucket=str(tmp / f"b-{plane}-{dtype}"), run="r", model=str(model), task="toy", n_samples=2,
                        eval_n=0, kl_beta=0.0, lora_rank=4, lora_alpha=8.0, dtype=dtype, plane=plane).validate()
    t = _Trainer(cfg, echo=lambda *_: None)
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
    tmp = Path(tempfile.mkdtemp(prefix="stoa-adapter-gap-"))
    try:
        model = tmp / "base"
        shutil.copytree(resolve_model("tiny"), model)
        w = load_file(str(model / "model.safetensors"))
        save_file({k: _bf16(v) for k, v in w.items()}, str(model / "model.safetensors"), metadata={"format": "pt"})
        for plane in ("bf16", "int8g64"):
            for tdtype in ("float32", "bfloat16"):
                t = _trainer(tmp, model, plane, tdtype)
                bucket = open_bucket(t.cfg.bucket)
                contract = RunContract.from_json(bucket.get(contract_key("r")))
                for eng in ("torch", "mlx"):
                    for edtype in ("float32", "bfloat16"):
                        wdir = download_model_files(bucket, "r", tmp / f"w-{plane}-{tdtype}-{eng}-{edtype}")
                        engine = make_engine(eng, wdir, dtype=edtype, device="cpu")
                        check = prepare_adapter(engine, eng, bucket, contract, wdir, echo=lambda *_: None)
                        sync = WeightSync(bucket, "r", contract.weight_plane, run_key=contract.run_key, check=check)
                        engine.load_state(sync.sync()[1], contract.weight_plane)
                        print(f"base {plane:8s} trainer {tdtype:9s} worker {eng:5s} {edtype:9s} "
                              f"worst gap {worst_gap(engine, t.policy):.2e}", flush=True)
                t.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
