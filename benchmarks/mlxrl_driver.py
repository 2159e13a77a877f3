# pyright: reportMissingImports=false
"""Times mlxrl's own GRPO step (rollout, old/ref logprobs, optimizer step) on a shape given as JSON.

Not imported by stoa: ``stoa bench local --targets mlxrl`` runs this file with the python of a separate venv
that has mlxrl installed (``--mlxrl-python``; its pins: ``requirements-mlxrl.txt``) and reads the
``RESULT {json}`` line it prints. Usage::

    /path/to/mlxrl-venv/bin/python benchmarks/mlxrl_driver.py '{"model_dir": ..., "G": 8, ...}'
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
import time
from typing import Any


def load_blas(spec: dict[str, Any]) -> None:
    """Load the same BLAS as the stoa MLX target, before mlx is imported (as stoa does)."""
    if spec.get("mkl_rt"):
        os.environ.setdefault("MKL_THREADING_LAYER", "SEQUENTIAL")
        ctypes.CDLL(spec["mkl_rt"], mode=os.RTLD_GLOBAL | os.RTLD_NOW)


def build_model(spec: dict[str, Any]) -> tuple[Any, Any]:
    """mlxrl's LoRA model on the same base as stoa's: decoder-block linears quantized, embeddings and head in float."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlxrl.rollout.naive as naive
    import mlxrl.rollout.optimized as optimized
    from mlx_lm import load
    from mlxrl.policy.model import LoRAConfig, assert_only_lora_trainable, inject_lora_adapters

    if spec["ignore_eos"]:  # every completion runs to max_tokens, as in the stoa runs
        naive.eos_token_ids_from_tokenizer = lambda tokenizer: frozenset()
        if hasattr(optimized, "eos_token_ids_from_tokenizer"):
            optimized.eos_token_ids_from_tokenizer = naive.eos_token_ids_from_tokenizer
    loaded: Any = load(spec["model_dir"])
    model, tokenizer = loaded[0], loaded[1]
    model.set_dtype(mx.float32)
    gs, bits = spec["group_size_q"], spec["bits"]
    blocks = {id(m) for layer in model.layers for _, m in layer.named_modules()}
    if bits < 16:
        nn.quantize(model, group_size=gs, bits=bits,
                    class_predicate=lambda p, m: id(m) in blocks and isinstance(m, nn.Linear)
                    and m.weight.shape[1] % gs == 0)
    inject_lora_adapters(model, LoRAConfig(rank=spec["rank"], scale=spec["scale"], dropout=0.0,
                                           grad_checkpoint=spec["checkpointing"]))
    model.freeze()
    model.unfreeze(keys=["lora_a", "lora_b"])
    assert_only_lora_trainable(model)
    model.eval()
    return model, tokenizer


def run_steps(spec: dict[str, Any], model: Any, tokenizer: Any) -> list[dict[str, float]]:
    """One timed mlxrl GRPO step per prompt of the spec."""
    import mlx.core as mx
    import mlx.optimizers as optim
    import mlxrl.rollout.naive as naive
    import mlxrl.rollout.optimized as optimized
    from mlxrl.algo.grpo import GRPOAlgorithm
    from mlxrl.policy.logprobs import pad_token_id_from_tokenizer
    from mlxrl.train.grpo import batch_from_rollouts, optimizer_step

    pad = pad_token_id_from_tokenizer(tokenizer)
    sampling = naive.SamplingConfig(max_tokens=spec["max_tokens"], temperature=1.0, top_p=1.0)
    algorithm, opt, ckpt = GRPOAlgorithm(), optim.Adam(learning_rate=spec["lr"]), spec["checkpointing"]
    rows = []
    for step, (prompt, answer) in enumerate(spec["prompts"]):
        t0 = time.perf_counter()
        if spec["rollout"] == "optimized":
            comps = optimized.generate_prefix_cached_group_rollouts(
                model, tokenizer, [prompt], spec["G"], sampling, seed=step, use_chat_template=True, batch_groups=True)
        else:
            comps = naive.generate_group_rollouts(model, tokenizer, [prompt], spec["G"], sampling, seed=step,
                                                  use_chat_template=True)
        t1 = time.perf_counter()
        rewards = [float(answer in c.text) for c in comps]
        batch = batch_from_rollouts(model=model, completions=comps, rewards=rewards, group_size=spec["G"],
                                    pad_token_id=pad, algorithm=algorithm, use_checkpoint=ckpt,
                                    compute_reference=spec["beta"] != 0.0)
        optimizer_step(model=model, optimizer=opt, batch=batch, beta=spec["beta"], pad_token_id=pad,
                       algorithm=algorithm, use_checkpoint=ckpt, micro_batch_size=0)
        mx.eval(model.trainable_parameters(), opt.state)
        t2 = time.perf_counter()
        new = sum(len(c.completion_tokens) for c in comps)
        rows.append({"rollout_s": t1 - t0, "tokens": new, "tokens_per_s": new / (t1 - t0), "step_s": t2 - t0,
                     "prompt_len": len(comps[0].prompt_tokens)})
    return rows


def main() -> None:
    spec = json.loads(sys.argv[1])
    load_blas(spec)
    import mlx.core as mx

    rows = run_steps(spec, *build_model(spec))
    with open("/proc/self/maps") if sys.platform == "linux" else open(os.devnull) as f:
        maps = f.read()
    blas = "mkl" if "libmkl_rt" in maps else ("reference" if sys.platform == "linux" else "platform")
    print("RESULT " + json.dumps({"rows": rows, "allocator_peak_mb": mx.get_peak_memory() / 1e6, "blas": blas,
                                  "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


if __name__ == "__main__":
    main()
