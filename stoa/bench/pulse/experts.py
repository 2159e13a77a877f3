"""PULSE on mixture-of-experts models: patch size, changed values per tensor kind and per expert, encode/apply
speed, over real GRPO steps of the trainer (``stoa.trainer.step.train_step``) on a tiny MoE model.

An expert that no token was routed to gets an exactly zero gradient, so AdamW leaves it unchanged until some
token reaches it (after that its moments keep it moving); its stored bits then do not change either and it
costs nothing in the patch. How many experts stay untouched depends on tokens per step against experts times
top-k: at RL batch sizes every expert is reached, so the patch ratio of a MoE comes from bf16 rounding (most
updates at lr ~1e-5 are below half an ulp), as for a dense model. ``--experts`` rebuilds the tiny model with
more experts to show the sparse regime.

Run: ``python -m stoa.bench.pulse.experts --model tiny-qwen3-moe --steps 4`` (one JSON summary on stdout).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from stoa.algorithms import AlgoConfig, get_algorithm
from stoa.config.text import deprecated_flag
from stoa.models import resolve_model
from stoa.models.tiny_families import family_weights
from stoa.rollouts.records import RolloutRecord, Sample
from stoa.trainer.pool import Entry
from stoa.weights.patch_format import _parse
from stoa.weights.planes import PLANES, State, quant_stem, state_from_f32
from stoa.weights.pulse import apply_patch, encode_patch

_EXPERT_N = re.compile(r"\.experts\.(\d+)\.")
_QUANT_SUFFIXES = (".scales", ".biases")


def tensor_kind(name: str) -> str:
    """The kind a tensor's changes are counted under: expert, shared_expert, router, attention,
    linear_attention, conv, mlp, embedding, norm or other (``.scales``/``.biases`` count with their codes).

    Args:
        name: tensor name in torch's ``named_parameters`` naming (or a quantized plane's).
    """
    for suffix in _QUANT_SUFFIXES:
        name = name.removesuffix(suffix)
    rules = (
        ("router", (r"\.(mlp|feed_forward)\.gate(\.weight)?$", r"shared_expert_gate", r"expert_bias")),
        ("shared_expert", (r"\.shared_expert\.",)),
        ("expert", (r"\.experts\.",)),
        ("norm", (r"norm\.weight$", r"layernorm", r"_norm$")),
        ("conv", (r"\.conv\.conv\.", r"conv1d")),
        ("linear_attention", (r"\.linear_attn\.",)),
        ("conv", (r"\.conv\.",)),
        ("attention", (r"\.self_attn\.",)),
        ("embedding", (r"embed_tokens", r"lm_head")),
        ("mlp", (r"\.(mlp|feed_forward)\.",)),
    )
    for kind, patterns in rules:
        if any(re.search(p, name) for p in patterns):
            return kind
    return "other"


def expert_slices(name: str, arr: np.ndarray) -> dict[int, np.ndarray]:
    """Each expert's part of an expert tensor, flattened: the leading axis of a fused ``[E, ...]`` tensor,
    or the whole tensor of a per-expert ``experts.N.`` one; ``{}`` for any other tensor.

    Args:
        name: tensor name.
        arr: the tensor (stored bits or float32).
    """
    if tensor_kind(name) != "expert":
        return {}
    m = _EXPERT_N.search(name)
    if m:
        return {int(m.group(1)): arr.reshape(-1)}
    return {e: arr[e].reshape(-1) for e in range(arr.shape[0])} if arr.ndim == 3 else {}


def changed_by_kind(prev: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray]) -> dict[str, tuple[int, int]]:
    """Per kind: (values whose stored bits changed, values in all).

    Args:
        prev: stored bits before.
        new: stored bits after (same layout).
    """
    out: dict[str, tuple[int, int]] = {}
    for name, a in new.items():
        c, n = out.get(tensor_kind(name), (0, 0))
        out[tensor_kind(name)] = (c + int(np.count_nonzero(prev[name] != a)), n + a.size)
    return out


@dataclass(frozen=True)
class ExpertSparsity:
    """Per step, over every (layer, expert) pair: how many were touched (master weights changed), and how many
    stored values changed in the touched and in the untouched ones (the latter must be 0)."""

    experts: int
    touched: int
    changed_touched: int
    values_touched: int
    changed_untouched: int


def expert_sparsity(prev32: Mapping[str, np.ndarray], new32: Mapping[str, np.ndarray], prev: State,
                    new: State) -> ExpertSparsity:
    """Which experts this step moved, and what their stored bits did.

    Args:
        prev32: float32 masters before the step.
        new32: float32 masters after.
        prev: stored plane before.
        new: stored plane after.
    """
    touched: dict[tuple[str, int], bool] = {}
    for name, a in new32.items():
        group = name.rsplit(".experts", 1)[0]
        for e, sl in expert_slices(name, a).items():
            moved = not np.array_equal(expert_slices(name, prev32[name])[e], sl)
            touched[(group, e)] = touched.get((group, e), False) or moved
    counts = {"changed_touched": 0, "values_touched": 0, "changed_untouched": 0}
    for name, a in new.items():
        base = quant_stem(name.removesuffix(".scales").removesuffix(".biases"))
        group = base.rsplit(".experts", 1)[0]
        for e, sl in expert_slices(base, a).items():
            changed = int(np.count_nonzero(expert_slices(base, prev[name])[e] != sl))
            if touched.get((group, e), True):
                counts["changed_touched"] += changed
                counts["values_touched"] += sl.size
            else:
                counts["changed_untouched"] += changed
    return ExpertSparsity(len(touched), sum(touched.values()), **counts)


@dataclass(frozen=True)
class PlaneStep:
    """One plane's figures for one step."""

    plane: str
    patch_bytes: int
    state_bytes: int
    ratio: float
    bytes_by_kind: dict[str, int]
    changed_frac_by_kind: dict[str, float]
    experts: ExpertSparsity
    encode_s: float
    apply_s: float
    bit_exact: bool


def measure_plane(plane: str, prev32: Mapping[str, np.ndarray], new32: Mapping[str, np.ndarray],
                  version: int, repeat: int = 3) -> PlaneStep:
    """Encode the patch between two master states in ``plane``, apply it, and check the result bit for bit.

    Args:
        plane: ``bf16`` or ``int8g64``.
        prev32: float32 masters at ``version``.
        new32: float32 masters at ``version + 1``.
        version: the base version.
        repeat: timing repeats (medians).
    """
    prev, new = state_from_f32(prev32, plane), state_from_f32(new32, plane)
    enc, apl = [], []
    patch, got = b"", {}
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        patch = encode_patch(prev, new, run_id="bench", from_version=version, to_version=version + 1,
                             plane=plane)
        t1 = time.perf_counter()
        got, _ = apply_patch(prev, patch, run_id="bench", expected_from_version=version, plane=plane)
        enc.append(t1 - t0)
        apl.append(time.perf_counter() - t1)
    _, entries, _ = _parse(patch)
    by_kind: dict[str, int] = {}
    for e in entries:
        by_kind[tensor_kind(e.name)] = by_kind.get(tensor_kind(e.name), 0) + e.length
    exact = got.keys() == new.keys() and all(got[k].dtype == new[k].dtype and got[k].tobytes() == new[k].tobytes()
                                             for k in new)
    state_bytes = sum(v.nbytes for v in new.values())
    kinds = changed_by_kind(prev, new)
    return PlaneStep(plane, len(patch), state_bytes, state_bytes / len(patch), dict(sorted(by_kind.items())),
                     {k: c / n for k, (c, n) in sorted(kinds.items())}, expert_sparsity(prev32, new32, prev, new),
                     float(np.median(enc)), float(np.median(apl)), exact)


@dataclass
class Summary:
    """The run's rows (one per step and plane) and the step metrics of the trainer."""

    model: str
    lr: float
    steps: list[dict[str, Any]] = field(default_factory=list)


def variant_model(model_dir: Path, experts: int, out_dir: Path) -> Path:
    """Copy a tiny family MoE model with ``experts`` experts (new random weights, same tokenizer).

    Args:
        model_dir: a tiny MoE model directory (built by ``stoa.models``).
        experts: number of experts.
        out_dir: where to write the variant.
    """


    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    if "num_experts" not in text:
        raise ValueError(f"{model_dir} is not a MoE model (no num_experts); pick a tiny-*-moe model")
    text["num_experts"] = experts
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out_dir / f.name)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(family_weights(config), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def sampled_entries(policy: Any, rng: np.random.Generator, groups: int, n: int, prompt_len: int,
                    new_tokens: int) -> list[Any]:
    """GRPO groups sampled from the policy itself (full forward per token, so every family works), with the
    sampling logprobs recorded (on-policy) and 0/1 rewards, half of each group 1 in random order.

    Args:
        policy: a :class:`stoa.trainer.policy.Policy`.
        rng: randomness for prompts, tokens and rewards.
        groups: groups per step.
        n: completions per group.
        prompt_len: prompt tokens.
        new_tokens: completion tokens.
    """
    import torch


    vocab = int(policy.model.config.get_text_config().vocab_size)
    out = []
    policy.model.eval()
    for g in range(groups):
        prompt = rng.integers(3, vocab, prompt_len).astype(np.int32)
        ids = torch.tensor(np.tile(prompt, (n, 1)), dtype=torch.long)
        lps = []
        with torch.no_grad():
            for _ in range(new_tokens):
                logp = torch.log_softmax(policy.model(input_ids=ids).logits[:, -1].float(), -1)
                u = torch.from_numpy(rng.random(n)).float()
                tok = torch.searchsorted(torch.cumsum(logp.exp(), -1), u[:, None]).clamp(max=vocab - 1)
                lps.append(logp.gather(1, tok))
                ids = torch.cat([ids, tok], 1)
        comp = ids[:, prompt_len:].numpy().astype(np.int32)
        lp = torch.cat(lps, 1).numpy().astype(np.float32)
        rewards = rng.permutation(np.arange(n) % 2).astype(np.float32)  # mixed, so every group has a signal
        samples = [Sample(comp[i], lp[i], float(rewards[i]), "length") for i in range(n)]
        out.append(Entry(f"k{g}", RolloutRecord("w", g, 0, "f", "toy", f"train:{g}", prompt, samples), rewards))
    policy.model.train()
    return out


def run(model: str, steps: int, lr: float, planes: tuple[str, ...], groups: int = 4, n: int = 4,
        new_tokens: int = 12, experts: int = 0, seed: int = 0) -> Summary:
    """Train ``steps`` GRPO steps with AdamW and measure each step's patch in every plane.

    Args:
        model: a model name or directory (``stoa.models.resolve_model``).
        steps: optimizer steps.
        lr: AdamW learning rate (weight decay 0 and grad clip 1, the trainer's defaults).
        planes: planes to measure.
        groups: groups per step.
        n: completions per group.
        new_tokens: tokens per completion.
        experts: rebuild the tiny MoE with this many experts (0: as it is).
        seed: seed of prompts, samples and rewards.
    """
    import torch

    from stoa.trainer.policy import Policy
    from stoa.trainer.step import train_step

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(resolve_model(model))
        if experts:
            model_dir = variant_model(model_dir, experts, Path(tmp) / "variant")
        torch.manual_seed(seed)
        policy = Policy(model_dir, torch.device("cpu"))
        opt = torch.optim.AdamW(policy.model.parameters(), lr=lr, weight_decay=0.0)
        algo = get_algorithm(AlgoConfig.from_dict({"name": "grpo", "kl_beta": 0.0}), "torch")
        rng = np.random.default_rng(seed)
        summary = Summary(model + (f"+{experts}experts" if experts else ""), lr)
        prev32 = {k: v.copy() for k, v in policy.export_f32().items()}
        for step in range(steps):
            entries = sampled_entries(policy, rng, groups, n, 8, new_tokens)
            m = train_step(policy, None, opt, algo, entries, current_version=0, micro_batch=16, grad_clip=1.0,
                           step=step)
            new32 = {k: v.copy() for k, v in policy.export_f32().items()}
            for plane in planes:
                row = asdict(measure_plane(plane, prev32, new32, step + 1))
                summary.steps.append({"step": step, "loss": m["loss"], "tokens": m["tokens"], **row})
            prev32 = new32
    return summary


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``stoa bench pulse-experts``.

    Args:
        p: the subcommand's parser.
    """
    p.add_argument("--model", default="tiny-qwen3-moe", help="a MoE model name or directory [default: tiny-qwen3-moe]")
    p.add_argument("--steps", type=int, default=4, help="GRPO steps [default: 4]")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate [default: 1e-05]")
    p.add_argument("--planes", default=",".join(PLANES), help=f"planes to measure [default: {','.join(PLANES)}]")
    p.add_argument("--groups", type=int, default=4, help="groups per step [default: 4]")
    p.add_argument("--n-samples", dest="n", metavar="N", type=int, default=4, help="samples per group [default: 4]")
    deprecated_flag(p, "--n", "--n-samples")
    p.add_argument("--max-new-tokens", dest="new_tokens", metavar="N",
                   type=int, default=12, help="tokens sampled per row [default: 12]")
    deprecated_flag(p, "--new-tokens", "--max-new-tokens")
    p.add_argument("--experts", type=int, default=0, help="rebuild the tiny MoE with this many experts [default: 0]")


def main(args: argparse.Namespace) -> int:
    """Print the JSON summary of :func:`run`.

    Args:
        args: parsed flags (see ``add_arguments``).
    """
    s = run(args.model, args.steps, args.lr, tuple(args.planes.split(",")), args.groups, args.n, args.new_tokens,
            args.experts)
    print(json.dumps(asdict(s), indent=1))
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m stoa.bench.pulse.experts")
    add_arguments(_parser)
    raise SystemExit(main(_parser.parse_args()))
