"""How fast a trainer step could be on this CPU: the matrix-product floor of our step and of TRL's at the shape of
``stoa bench trl``, and how much of the CPU's bf16 matmul rate a decoder's forward + backward really gets.

A GRPO step with a KL term runs the reference forward, the policy forward and its backward (twice a forward's
FLOPs): 4 forwards' worth of matrix products in a full fine-tune, 3 with LoRA (a frozen base needs no weight
gradient). Ours runs each group's prompt once (shared prefix); TRL runs it in every row. At the CPU's bf16 matmul
rate both floors follow from the model's shape alone; the ratio of the two floors is the step ratio if both sides
ran at the same fraction of that rate. The decoder's measured fraction (eager, and with ``--compile`` through
``torch.compile``) bounds what a whole step, with its attention, norms, log-softmax and optimizer, can reach.
Pass the measured step times (``--ours-s``, ``--trl-s``: ``stoa bench trl``'s table) to see each side's fraction.
Usage::

    python benchmarks/step_floor.py                      # SmolLM2-135M, full fine-tune
    python benchmarks/step_floor.py --compile --ours-s 24.3 --trl-s 33.1
    python benchmarks/step_floor.py --lora
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from stoa.models import resolve_model
from stoa.models.registry import UnknownModel


def macs_per_token(cfg: Any) -> tuple[int, int]:
    """Multiply-accumulates per token: the decoder's linears, and the LM head's."""
    hidden, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    return layers * (2 * hidden * q + 2 * hidden * kv + 3 * hidden * inter), hidden * cfg.vocab_size


def alternating_s(fns: dict[str, Any], repeats: int) -> dict[str, float]:
    """Median seconds of each ``fns`` call, one warm-up each, then the calls alternating ``repeats`` times (so load
    that comes and goes touches every one alike)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def matmul_step(m: int, k: int, n: int) -> Any:
    """Ten bf16 [m, k] x [k, n] products."""
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16)
    return lambda: [a @ b for _ in range(10)]


def decoder_step(decoder: Any, rows: int, width: int, vocab: int) -> Any:
    """The decoder's forward + backward on ``rows`` x ``width`` tokens."""
    ids = torch.randint(0, vocab, (rows, width))
    return lambda: decoder(input_ids=ids).last_hidden_state.float().square().mean().backward()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--lora", action="store_true", help="3 forwards' worth per step (no weight gradient of the base)")
    p.add_argument("--compile", action="store_true", help="also time the decoder through torch.compile")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--ours-s", type=float, help="our measured step, seconds")
    p.add_argument("--trl-s", type=float, help="TRL's measured step (without generation), seconds")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    try:
        model_dir = resolve_model(a.model)
    except UnknownModel as e:
        raise SystemExit(f"step_floor: {e}") from None
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).train()
    body, head = macs_per_token(model.config)
    scored = a.prompts * a.generations * a.tokens
    passes = 3 if a.lora else 4
    ours = passes * 2 * (body * a.prompts * (a.prompt_tokens + a.generations * (a.tokens - 1)) + head * scored)
    trl = passes * 2 * (body * a.prompts * a.generations * (a.prompt_tokens + a.tokens) + head * scored)
    m, hidden = a.generations * (a.tokens - 1), model.config.hidden_size
    rows, width = a.generations, a.prompt_tokens + a.tokens - 1
    fns = {"matmul": matmul_step(m, hidden, model.config.intermediate_size),
           "eager": decoder_step(model.get_decoder(), rows, width, model.config.vocab_size)}
    if a.compile:
        fns["torch.compile"] = decoder_step(torch.compile(model.get_decoder()), rows, width, model.config.vocab_size)
    seconds = alternating_s(fns, a.repeats)
    peak = 10 * 2 * m * hidden * model.config.intermediate_size / seconds.pop("matmul") / 1e9
    rates = {name: 3 * 2 * body * rows * width / s / 1e9 for name, s in seconds.items()}
    print(f"{a.model}, {a.threads} threads, {'LoRA' if a.lora else 'full fine-tune'}: {a.prompts} x {a.generations} "
          f"rows of {a.prompt_tokens} + {a.tokens} tokens, {passes} forwards' worth per step")
    print(f"bf16 matmul rate (the step's MLP shape): {peak:.0f} GFLOP/s")
    for name, r in rates.items():
        print(f"decoder forward + backward, {name}: {r:.0f} GFLOP/s ({r / peak:.0%} of the matmul rate)")
    best = max(rates.values())
    print("| side | matmul TFLOP per step | s at the matmul rate | s at the decoder's best rate | measured s (rate) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for side, f, measured in (("ours (prompt once per group)", ours, a.ours_s), ("TRL (prompt in every row)", trl,
                                                                                   a.trl_s)):
        seen = f"{measured:.2f} ({f / measured / 1e9 / peak:.0%})" if measured else "-"
        print(f"| {side} | {f / 1e12:.2f} | {f / peak / 1e9:.2f} | {f / best / 1e9:.2f} | {seen} |")
    print(f"step ratio if both sides ran at one rate: {trl / ours:.2f}")
    if a.trl_s:
        print(f"step ratio if ours ran at the decoder's best rate: {a.trl_s / (ours / best / 1e9):.2f} "
              f"(at the matmul rate itself: {a.trl_s / (ours / peak / 1e9):.2f})")


if __name__ == "__main__":
    main()
