"""Ratio drift per model family: how far the trainer's recompute is from a worker's recorded logprobs, and on MoE
models how often the two sides route a token to different experts.

``stoa bench families [--models tiny-lfm2,...]`` (or ``python benchmarks/family_drift.py``) samples on-policy
groups with the fp32 torch engine (and the fp32 MLX engine where it loads the family), then scores every sampled
token with the trainer's ``Policy`` in fp32 and in bf16 (``compute_dtype``, autocast over fp32 master weights).
Per pair, with d = trainer - worker logprob per token: mean |d|, max |d|, mean exp(d) (the on-policy importance
ratio, 1 when both sides agree) and the share of tokens the DPPO gate would mask (tv gate at its default
threshold: |p - mu| > delta, masked when the advantage pushes the way p moved, so this share is the gate's worst
case over advantage signs).

On MoE models every router (transformers' ``*TopKRouter``) is hooked on both sides: the worker's decode is replayed
teacher-forced at batch 1 on the engine's model with a KV cache (prompt prefill, then one token a step, as the
worker ran it), the trainer's side is its full forward, and the report gives the share of (token, MoE layer)
pairs whose top-k expert sets differ and the share of tokens with any layer differing. The MLX side's routing is
not hooked (mlx-lm's MoE blocks have no hook point); its logprob drift is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stoa.config.text import deprecated_flag

FAMILIES = ("tiny-qwen3", "tiny-qwen3-moe", "tiny-lfm2", "tiny-lfm2-moe", "tiny-qwen3.5", "tiny-qwen3.5-moe")


@dataclass(frozen=True)
class Records:
    """On-policy rows as a worker records them: each row's prompt (index into ``prompts``), tokens and logprobs."""

    prompts: list[list[int]]
    group: list[int]
    tokens: list[list[int]]
    logprobs: list[np.ndarray]


@dataclass(frozen=True)
class Drift:
    """Trainer-vs-worker figures over every sampled token (d = trainer - worker logprob)."""

    tokens: int
    mean_abs: float
    max_abs: float
    mean_ratio: float
    gate_share: float
    """Share of tokens with |exp(trainer) - exp(worker)| past the tv gate's threshold."""
    mean_p: float
    """Mean worker probability of the sampled tokens: the tv gate needs p near delta to fire at all."""
    clip_share: float
    """Share of tokens whose on-policy ratio exp(d) is outside PPO's clip range [1 - eps_low, 1 + eps_high]: the
    drift that counts where probabilities are small (a random model's), which the tv gate cannot see."""
    route_flip: float | None = None
    """MoE: share of (token, MoE layer) pairs whose top-k expert sets differ (None: not measured)."""
    route_any: float | None = None
    """MoE: share of tokens with a different expert set in at least one layer."""


def _records(groups: Sequence[Sequence[Any]], prompts: list[list[int]]) -> Records:
    """Flatten an engine's per-prompt completions into rows."""
    rows = [(g, c) for g, group in enumerate(groups) for c in group if len(c.tokens)]
    return Records(prompts, [g for g, _ in rows], [list(c.tokens) for _, c in rows],
                   [np.asarray(c.logprobs, np.float64) for _, c in rows])


def sample_torch(model_dir: Path, prompts: list[list[int]], n: int, max_new: int, temperature: float, seed: int
                 ) -> tuple[Records, Any]:
    """Sample with the fp32 torch engine (the records) and return the engine too (its model replays the routing)."""
    from stoa.engines.torch import TorchEngine

    eng = TorchEngine(model_dir, device="cpu", dtype="float32")
    groups, _ = eng.generate(prompts, n, max_new_tokens=max_new, temperature=temperature,
                             generator=eng.make_generator(seed))
    return _records(groups, prompts), eng


def sample_mlx(model_dir: Path, prompts: list[list[int]], n: int, max_new: int, temperature: float, seed: int
               ) -> Records | str:
    """Sample with the fp32 MLX engine; a one-line reason instead when MLX is missing or refuses the family."""
    try:
        from stoa.engines.mlx.engine import MLXEngine

        eng = MLXEngine(model_dir, dtype="float32")
        groups, _ = eng.generate(prompts, n, max_new_tokens=max_new, temperature=temperature, generator=seed)
    except (ImportError, ValueError, NotImplementedError, RuntimeError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return _records(groups, prompts)


def routers(model: Any) -> list[Any]:
    """The MoE routers of a transformers model, in layer order (``*TopKRouter``: forward returns logits, weights,
    expert indices)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


@contextlib.contextmanager
def recording_routes(model: Any) -> Iterator[list[list[np.ndarray]]]:
    """Hook every router; yields a list that gets, per forward, the [tokens, k] expert ids of each MoE layer."""
    calls: list[list[np.ndarray]] = []
    mods = routers(model)

    def hook(module: Any, _inputs: Any, output: Any) -> None:
        ids = np.sort(output[2].detach().cpu().numpy(), axis=-1)
        if mods.index(module) == 0:
            calls.append([])
        calls[-1].append(ids)

    handles = [m.register_forward_hook(hook) for m in mods]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def worker_routes(model: Any, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """[positions, MoE layers, k] expert ids of the worker's decode, replayed teacher-forced at batch 1: the prompt
    prefilled, then each sampled token but the last fed alone on the cache (positions 0 .. len(prompt+tokens)-2)."""
    import inspect

    import torch
    from transformers import DynamicCache

    kw = {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values":
          DynamicCache(config=model.config)}
    with torch.inference_mode(), recording_routes(model) as calls:
        model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1, **kw)
        for t in tokens[:-1]:
            model(input_ids=torch.tensor([[t]]), use_cache=True, logits_to_keep=1, **kw)
    return np.concatenate([np.stack(c, axis=1) for c in calls], axis=0)


def trainer_side(policy: Any, rec: Records, temperature: float, moe: bool
                 ) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """The trainer's logprobs of every row (packed forward, one group a time) and, on MoE models, each row's
    [positions, MoE layers, k] expert ids of that same forward."""
    import torch

    from stoa.engines.torch_scoring import pack_tensors

    lps: list[np.ndarray] = [np.zeros(0)] * len(rec.tokens)
    routes: list[np.ndarray] = [np.zeros(0)] * len(rec.tokens)
    for g, prompt in enumerate(rec.prompts):
        rows = [i for i, gi in enumerate(rec.group) if gi == g]
        if not rows:
            continue
        comps = [np.asarray(rec.tokens[i]) for i in rows]
        t_max = max(len(c) for c in comps)
        batch = pack_tensors([np.asarray(prompt)] * len(rows), comps, t_max, policy.device)
        with torch.no_grad(), recording_routes(policy.model) as calls:
            logp = policy.score(batch).logp.double().cpu().numpy()
        width = batch.input_ids.shape[1]
        for b, i in enumerate(rows):
            lps[i] = logp[b, : len(comps[b])]
            if moe:  # the forward's routes are [(B * width), k] per layer; keep this row's real positions
                ids = np.stack([layer.reshape(len(rows), width, -1)[b] for layer in calls[0]], axis=1)
                routes[i] = ids[: len(prompt) + len(comps[b]) - 1]
    return lps, routes if moe else None


def drift(trainer: list[np.ndarray], worker: list[np.ndarray], delta: float,
          routes: tuple[list[np.ndarray], list[np.ndarray]] | None = None, eps: tuple[float, float] = (0.2, 0.2)
          ) -> Drift:
    """The figures of one trainer-vs-worker pair (see ``Drift``)."""
    t, w = np.concatenate(trainer), np.concatenate(worker)
    d = t - w
    flip = any_flip = None
    if routes is not None:
        diff = [np.any(a != b, axis=-1) for a, b in zip(*routes, strict=True)]  # [positions, layers] per row
        flip = float(np.mean(np.concatenate([x.reshape(-1) for x in diff])))
        any_flip = float(np.mean(np.concatenate([x.any(axis=1) for x in diff])))
    return Drift(int(d.size), float(np.abs(d).mean()), float(np.abs(d).max()), float(np.exp(d).mean()),
                 float(np.mean(np.abs(np.exp(t) - np.exp(w)) > delta)), float(np.exp(w).mean()),
                 float(np.mean((np.exp(d) < 1 - eps[0]) | (np.exp(d) > 1 + eps[1]))), flip, any_flip)


def family_report(name: str, *, groups: int, n: int, max_new: int, temperature: float, seed: int, mlx: bool
                  ) -> dict[str, Any]:
    """Every pair's ``Drift`` for one model (keys ``fp32_vs_torch32``, ``bf16_vs_torch32``, and the MLX pairs or
    the reason MLX was skipped)."""
    import torch

    from stoa.algorithms.base import DEFAULT_GATE_DELTAS
    from stoa.models import resolve_model
    from stoa.trainer.policy import Policy

    model_dir = Path(resolve_model(name))
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 500, int(rng.integers(6, 24))).tolist() for _ in range(groups)]
    rec, eng = sample_torch(model_dir, prompts, n, max_new, temperature, seed)
    moe = bool(routers(eng.model))
    w_routes = [worker_routes(eng.model, prompts[g], t) for g, t in zip(rec.group, rec.tokens, strict=True)] \
        if moe else None
    mlx_rec = sample_mlx(model_dir, prompts, n, max_new, temperature, seed) if mlx else "not asked (--no-mlx)"
    delta = DEFAULT_GATE_DELTAS["tv"]
    out: dict[str, Any] = {"model": name, "moe": moe, "tokens": sum(len(t) for t in rec.tokens),
                           "gate": f"tv {delta}"}
    for tag, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        pol = Policy(model_dir, torch.device("cpu"), temperature=temperature, trainable=False, compute_dtype=dtype)
        lps, t_routes = trainer_side(pol, rec, temperature, moe)
        pair = (t_routes, w_routes) if t_routes is not None and w_routes is not None else None
        out[f"{tag}_vs_torch32"] = asdict(drift(lps, rec.logprobs, delta, pair))
        if isinstance(mlx_rec, Records):
            m_lps, _ = trainer_side(pol, mlx_rec, temperature, False)
            out[f"{tag}_vs_mlx32"] = asdict(drift(m_lps, mlx_rec.logprobs, delta))
    if isinstance(mlx_rec, str):
        out["mlx"] = mlx_rec
    return out


def _fmt(x: float | None, spec: str) -> str:
    return format("-" if x is None else x, spec.replace(".2f", "") if x is None else spec)


def table(reports: Sequence[dict[str, Any]]) -> list[str]:
    """One line per (model, trainer-vs-worker pair)."""
    head = (f"{'model':18} {'pair':16} {'tokens':>6} {'mean|d|':>9} {'max|d|':>9} {'mean e^d':>9} "
            f"{'gate%':>6} {'mean p':>7} {'clip%':>6} {'route%':>7} {'tok-route%':>10}")
    lines = [head, "-" * len(head)]
    for r in reports:
        for key, v in r.items():
            if not key.endswith(("_vs_torch32", "_vs_mlx32")):
                continue
            flip = None if v["route_flip"] is None else 100 * v["route_flip"]
            any_ = None if v["route_any"] is None else 100 * v["route_any"]
            lines.append(f"{r['model']:18} {key:16} {v['tokens']:>6} {v['mean_abs']:>9.2e} {v['max_abs']:>9.2e} "
                         f"{v['mean_ratio']:>9.6f} {100 * v['gate_share']:>6.2f} {v['mean_p']:>7.3f} "
                         f"{100 * v['clip_share']:>6.2f} {_fmt(flip, '>7.2f')} {_fmt(any_, '>10.2f')}")
        if "mlx" in r:
            lines.append(f"{r['model']:18} mlx skipped: {r['mlx']}")
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``stoa bench families``.

    Args:
        p: the subcommand's parser.
    """
    p.add_argument("--models", default=",".join(FAMILIES),
                   help=f"comma-separated model names or directories [default: {','.join(FAMILIES)}]")
    p.add_argument("--groups", type=int, default=4, help="prompts per model [default: 4]")
    p.add_argument("--n-samples", dest="n", metavar="N", type=int, default=4, help="samples per prompt [default: 4]")
    deprecated_flag(p, "--n", "--n-samples")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens sampled per row [default: 32]")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature [default: 1.0]")
    p.add_argument("--seed", type=int, default=0, help="sampling seed [default: 0]")
    p.add_argument("--no-mlx", action="store_true", help="skip the MLX worker")
    p.add_argument("--json", type=Path, default=None, help="append one JSON line per model to this file")


def main(args: argparse.Namespace) -> int:
    """Run the drift report over the families; print the table (and JSON lines with ``--json``).

    Args:
        args: parsed flags (see ``add_arguments``).
    """
    reports = []
    for name in [m for m in args.models.split(",") if m]:
        r = family_report(name, groups=args.groups, n=args.n, max_new=args.max_new_tokens,
                          temperature=args.temperature, seed=args.seed, mlx=not args.no_mlx)
        reports.append(r)
        if args.json is not None:
            with open(args.json, "a", encoding="utf-8") as f:
                f.write(json.dumps(r) + "\n")
    for line in table(reports):
        print(line)
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python benchmarks/family_drift.py")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
