"""`stoa bench logprobs`: how far a worker's recorded logprobs (MLX or torch engine) are from the trainer's
fp32 recompute."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple


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
    """Sample with a worker engine as a worker would, recompute each token's logprob with torch fp32, compare.

    The engine (MLX, or the torch engine in ``dtype``) gets the model's float32 weights through the weight
    plane (``state_from_f32`` then ``load_state``), exactly what a worker pulls from the bucket, and samples
    arithmetic prompts. Two torch float32 references recompute the same tokens with one full forward over
    prompt + completion:
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
    from stoa.models import resolve_model
    from stoa.weights.planes import state_from_f32, state_to_f32

    model_dir = Path(resolve_model(model))
    master = _master_weights(model_dir)
    state = state_from_f32(master, plane)
    eng, generator = _engine(engine, model_dir, dtype, state, plane, seed)
    run = _sample(eng, generator, model_dir, groups, samples, tokens, temperature, seed)
    references = {"master": master, "plane": state_to_f32(state, plane)}
    report: dict[str, Any] = {"model": str(model_dir), "engine": engine, "dtype": dtype, "plane": plane,
                              "groups": groups, "samples": samples, "max_new_tokens": tokens,
                              "temperature": temperature, "tokens": run.new_tokens, "generate_s": run.seconds}
    for ref_name, weights in references.items():
        report[ref_name] = _gap(model_dir, weights, run.prompts, run.completions, temperature)
    for line in _table(report, model_dir.name, plane, list(references)):
        echo(line)
    if out is not None:
        with open(out, "a", encoding="utf-8") as f:
            f.write(json.dumps(report | {"time": time.time()}) + "\n")
    return report


class Sampled(NamedTuple):
    """What the engine sampled: prompt ids, completions per group, new tokens and generate seconds."""

    prompts: list[list[int]]
    completions: list[list[Any]]
    new_tokens: int
    seconds: float


def _sample(eng: Any, generator: Any, model_dir: Path, groups: int, samples: int, tokens: int,
            temperature: float, seed: int) -> Sampled:
    """Sample ``samples`` completions of ``groups`` arithmetic prompts (seeded), timing the generate call.

    Args:
        eng: the engine.
        generator: its sampling generator.
        model_dir: the model directory (tokenizer, chat template, EOS ids).
        groups: prompts.
        samples: completions per prompt.
        tokens: max new tokens.
        temperature: sampling temperature (top-p 1).
        seed: prompt seed.
    """
    import numpy as np

    from stoa.tasks import get_task
    from stoa.tokenize import TextCodec

    codec = TextCodec(model_dir)
    task = get_task("arithmetic")
    rng = np.random.default_rng(seed)
    prompts = [codec.encode_prompt(task.sample_train(rng).messages) for _ in range(groups)]
    t0 = time.perf_counter()
    comps, stats = eng.generate(prompts, samples, max_new_tokens=tokens, temperature=temperature,
                                eos_ids=codec.eos_ids, generator=generator)
    return Sampled(prompts, comps, stats.new_tokens, time.perf_counter() - t0)


def _master_weights(model_dir: Path) -> dict[str, Any]:
    """The model's float32 master weights from its safetensors files (what the trainer starts from).

    Args:
        model_dir: the model directory.
    """
    import numpy as np
    from safetensors.numpy import load_file

    master: dict[str, np.ndarray] = {}
    for f in sorted(model_dir.glob("model*.safetensors")):
        master.update({k: v.astype(np.float32) for k, v in load_file(str(f)).items()})
    if not master:
        raise FileNotFoundError(f"{model_dir} has no safetensors weights to compare")
    return master


def _engine(engine: str, model_dir: Path, dtype: str, state: Any, plane: str, seed: int) -> tuple[Any, Any]:
    """Build the worker engine and load the plane's state as a worker would; return it and its generator.

    Args:
        engine: ``mlx`` or ``torch``.
        model_dir: the model directory.
        dtype: the engine's compute dtype.
        state: the stored weights of ``plane``.
        plane: the weight plane.
        seed: sampling seed.
    """
    if engine == "mlx":
        from stoa.engines.mlx.engine import MLXEngine

        eng: Any = MLXEngine(model_dir, dtype=dtype)
        eng.load_state(state, plane)
        return eng, seed
    if engine == "torch":
        import torch

        from stoa.engines.torch import TorchEngine
        from stoa.weights.planes import state_to_f32

        eng = TorchEngine(model_dir, device="cpu", dtype=dtype)
        params = {name for name, _ in eng.model.named_parameters()}
        eng.load_weights({k: v for k, v in state_to_f32(state, plane).items() if k in params})
        return eng, torch.Generator().manual_seed(seed)
    raise ValueError(f"engine {engine!r}: use mlx or torch")


def _gap(model_dir: Path, weights: dict[str, Any], prompts: Sequence[list[int]],
         comps: Sequence[Sequence[Any]], temperature: float) -> dict[str, float]:
    """Recompute every sampled token's logprob with a torch float32 model of ``weights``; d = torch - engine.

    Returns mean and max ``|d|``, mean ``d`` and the mean importance ratio ``exp(d)``.

    Args:
        model_dir: the model directory (architecture).
        weights: the reference's float32 weights.
        prompts: prompt token ids, one per group.
        comps: the engine's completions per group (tokens and recorded logprobs).
        temperature: the sampling temperature (the reference scores with it).
    """
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    hf: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tensors = {k: torch.from_numpy(v) for k, v in weights.items()}
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise ValueError(f"reference weights do not fit the model: missing={missing} unexpected={unexpected}")
    diffs = []
    for prompt, group in zip(prompts, comps, strict=True):
        for c in group:
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + c.tokens])).logits[0, len(prompt) - 1 : -1].float()
            logp = torch.log_softmax(logits / temperature, -1)
            ref = logp.gather(-1, torch.tensor(c.tokens)[:, None])[:, 0]
            diffs.append(ref.numpy().astype(np.float64) - np.asarray(c.logprobs, np.float64))
    d = np.concatenate(diffs)
    return {"mean_abs": float(np.abs(d).mean()), "max_abs": float(np.abs(d).max()),
            "mean_diff": float(d.mean()), "mean_ratio": float(np.exp(d).mean())}


def _table(report: dict[str, Any], model_name: str, plane: str, references: Sequence[str]) -> list[str]:
    """The printed report: a heading and one row per reference.

    Args:
        report: the figures of :func:`run_logprob_report`.
        model_name: the model directory's name.
        plane: the weight plane (``report["plane"]`` holds the figures of the ``plane`` reference).
        references: the reference names, in print order.
    """
    lines = [f"{report['engine']} engine {report['dtype']} ({plane} plane) vs torch fp32 "
             f"recompute, {model_name}: {report['tokens']} tokens ({report['groups']} prompts x "
             f"{report['samples']}, T={report['temperature']})",
             f"{'reference':<10} {'mean |d|':>10} {'max |d|':>10} {'mean d':>10} {'mean exp(d)':>12}"]
    for ref_name in references:
        r = report[ref_name]
        lines.append(f"{ref_name:<10} {r['mean_abs']:>10.4f} {r['max_abs']:>10.4f} {r['mean_diff']:>10.4f} "
                     f"{r['mean_ratio']:>12.4f}")
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``stoa bench logprobs``.

    Args:
        p: the benchmark's parser.
    """
    from stoa.config.text import deprecated_flag

    p.add_argument("--model", default="smollm2-135m", help="model name or directory")
    p.add_argument("--engine", default="mlx", choices=("mlx", "torch"), help="the worker engine that samples")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"),
                   help="the engine's compute dtype")
    p.add_argument("--plane", default="bf16", choices=("bf16", "int8g64"), help="the weight plane it is given")
    p.add_argument("--groups", type=int, default=4, help="prompt groups sampled")
    p.add_argument("--n-samples", dest="samples", metavar="N", type=int, default=4, help="completions per group (n)")
    p.add_argument("--max-new-tokens", dest="tokens", metavar="N", type=int, default=64,
                   help="new tokens per completion")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--out", default=None, help="JSON file of the report [default: print only]")
    deprecated_flag(p, "--samples", "--n-samples")
    deprecated_flag(p, "--tokens", "--max-new-tokens")


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Command line for :func:`run_logprob_report`.

    Args:
        args: parsed flags (``add_arguments``), or arguments (default ``sys.argv[1:]``).
    """
    if isinstance(args, argparse.Namespace):
        a = args
    else:
        p = argparse.ArgumentParser(prog="python benchmarks/logprob_gap.py", description=__doc__)
        add_arguments(p)
        a = p.parse_args(args)
    run_logprob_report(a.model, a.dtype, a.plane, a.groups, a.samples, a.tokens, temperature=a.temperature,
                       seed=a.seed, engine=a.engine, out=a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
