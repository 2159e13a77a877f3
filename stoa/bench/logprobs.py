"""`python -m stoa.bench.logprobs`: how far a worker's recorded logprobs (MLX or torch engine) are from the trainer's fp32 recompute."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def run_logprob_report(
    model: str = "smollm2-135m",
    dtype: str = "bfloat16",
    plane: str = "bf16",
    groups: int = 4,
    samples: int = 4,
    tokens: int = 64,
    *,
    temperature: float = 1.0,
    seed: int = 0,
    engine: str = "mlx",
    out: str | Path | None = None,
    echo: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Sample with a worker engine as a worker would, recompute every token's logprob with torch fp32, compare.

    The engine (MLX, or the torch engine in ``dtype``) gets the model's float32 weights through the weight plane (``state_from_f32`` then
    ``load_state``), exactly what a worker pulls from the bucket, and samples arithmetic prompts. Two torch
    float32 references recompute the same tokens with one full forward over prompt + completion:
    ``master`` (the trainer's float32 master weights) and ``plane`` (the plane's weights widened to fp32,
    which isolates the MLX compute dtype). For each, d = torch - mlx per token: mean and max |d|, and the
    mean importance ratio exp(d) the trainer would see for on-policy data.

    Args:
        model: model name or directory (``resolve_model``).
        dtype: the engine's compute dtype (``bfloat16`` as on Metal and bf16-capable CPUs, or ``float32``).
        plane: weight plane (``bf16`` or ``int8g64``).
        groups: prompts.
        samples: completions per prompt.
        tokens: max new tokens.
        temperature: sampling temperature (top-p 1).
        seed: prompt and sampling seed.
        engine: ``mlx`` or ``torch``.
        out: JSONL file to append the figures to (None: do not write).
        echo: where the report goes.

    Returns:
        the figures per reference, plus counts and settings.
    """
    import numpy as np
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from stoa.models import resolve_model
    from stoa.tasks import get_task
    from stoa.tokenize import TextCodec
    from stoa.weights.planes import state_from_f32, state_to_f32
    model_dir = Path(resolve_model(model))
    master: dict[str, np.ndarray] = {}
    for f in sorted(model_dir.glob("model*.safetensors")):
        master.update({k: v.astype(np.float32) for k, v in load_file(str(f)).items()})
    if not master:
        raise FileNotFoundError(f"{model_dir} has no safetensors weights to compare")
    state = state_from_f32(master, plane)
    eng: Any
    if engine == "mlx":
        from stoa.engines.mlx.engine import MLXEngine

        eng = MLXEngine(model_dir, dtype=dtype)
        eng.load_state(state, plane)
        generator: Any = seed
    elif engine == "torch":
        from stoa.engines.torch import TorchEngine

        eng = TorchEngine(model_dir, device="cpu", dtype=dtype)
        params = {name for name, _ in eng.model.named_parameters()}
        eng.load_weights({k: v for k, v in state_to_f32(state, plane).items() if k in params})
        generator = torch.Generator().manual_seed(seed)
    else:
        raise ValueError(f"engine {engine!r}: use mlx or torch")
    codec = TextCodec(model_dir)
    task = get_task("arithmetic")
    rng = np.random.default_rng(seed)
    prompts = [codec.encode_prompt(task.sample_train(rng).messages) for _ in range(groups)]
    t0 = time.perf_counter()
    comps, stats = eng.generate(prompts, samples, max_new_tokens=tokens, temperature=temperature,
                                eos_ids=codec.eos_ids, generator=generator)
    gen_s = time.perf_counter() - t0

    references = {"master": master, "plane": state_to_f32(state, plane)}
    report: dict[str, Any] = {"model": str(model_dir), "engine": engine, "dtype": dtype, "plane": plane, "groups": groups,
                              "samples": samples, "max_new_tokens": tokens, "temperature": temperature,
                              "tokens": stats.new_tokens, "generate_s": gen_s}
    for ref_name, weights in references.items():
        hf: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        missing, unexpected = hf.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
        if unexpected or [m for m in missing if m != "lm_head.weight"]:
            raise ValueError(f"reference weights do not fit the model: missing={missing} unexpected={unexpected}")
        diffs = []
        for prompt, group in zip(prompts, comps, strict=True):
            for c in group:
                with torch.no_grad():
                    logits = hf(torch.tensor([prompt + c.tokens])).logits[0, len(prompt) - 1 : -1].float()
                ref = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(c.tokens)[:, None])[:, 0]
                diffs.append(ref.numpy().astype(np.float64) - np.asarray(c.logprobs, np.float64))
        d = np.concatenate(diffs)
        report[ref_name] = {"mean_abs": float(np.abs(d).mean()), "max_abs": float(np.abs(d).max()),
                            "mean_diff": float(d.mean()), "mean_ratio": float(np.exp(d).mean())}
    echo(f"{engine} engine {dtype} ({plane} plane) vs torch fp32 recompute, {model_dir.name}: {report['tokens']} tokens "
         f"({groups} prompts x {samples}, T={temperature})")
    echo(f"{'reference':<10} {'mean |d|':>10} {'max |d|':>10} {'mean d':>10} {'mean exp(d)':>12}")
    for ref_name in references:
        r = report[ref_name]
        echo(f"{ref_name:<10} {r['mean_abs']:>10.4f} {r['max_abs']:>10.4f} {r['mean_diff']:>10.4f} "
             f"{r['mean_ratio']:>12.4f}")
    if out is not None:
        with open(out, "a", encoding="utf-8") as f:
            f.write(json.dumps(report | {"time": time.time()}) + "\n")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Command line for :func:`run_logprob_report`.

    Args:
        argv: arguments (default ``sys.argv[1:]``).
    """
    p = argparse.ArgumentParser(prog="python -m stoa.bench.logprobs", description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--engine", default="mlx", choices=("mlx", "torch"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--plane", default="bf16", choices=("bf16", "int8g64"))
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    run_logprob_report(a.model, a.dtype, a.plane, a.groups, a.samples, a.tokens, temperature=a.temperature,
                       seed=a.seed, engine=a.engine, out=a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
