"""`stoa bench pulse`: PULSE patch size, encode/apply speed and bit-exactness over real AdamW RL steps."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from stoa.bucket import Bucket, open_bucket
from stoa.layout import patch_key
from stoa.weights.hashing import state_hash
from stoa.weights.planes import PLANES, State, bf16_bits_to_f32, f32_to_bf16_bits, state_from_f32
from stoa.weights.publish import WeightPublisher
from stoa.weights.pulse import apply_patch, default_threads, encode_patch, read_patch_header
from stoa.weights.sync import WeightSync

T = TypeVar("T")

DEFAULT_LRS = "1e-6,1e-5"
ANCHOR_EVERY = 1_000_000_000
"""The patch run's anchor cadence: only the first publish (the initial weights) is an anchor."""
GRAD_CLIP = 1.0
"""Global gradient-norm clip, the trainer's default (``TrainerConfig.grad_clip``)."""
WEIGHT_DECAY = 0.0
"""AdamW weight decay, the trainer's default (``TrainerConfig.weight_decay``)."""
BEHIND = 3
"""How many versions behind the "patches" catch-up worker is."""
INITS = ("checkpoint", "bf16")
SYSTEM = "Answer briefly."
"""System message for chat-templated prompts (keeps SmolLM2's long default system prompt out)."""

PROMPTS = (
    "Tom has 12 apples and gives 5 to Anna. How many apples does Tom have left?",
    "A train travels 60 km per hour for 3 hours. How far does it go?",
    "Sara buys 4 boxes of pencils with 8 pencils in each box. How many pencils does she have?",
    "Half of a number is 21. What is the number?",
)
"""Prompt texts (chat-templated when the tokenizer has a template); one GRPO group each."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``stoa bench pulse`` flags to ``parser``.

    Args:
        parser: the (sub)command parser.
    """
    parser.add_argument("--model", default="smollm2-135m", help="model name or directory (default smollm2-135m)")
    parser.add_argument("--steps", type=int, default=5, help="AdamW steps (published versions) per lr (default 5)")
    parser.add_argument(
        "--lr",
        action="append",
        default=None,
        metavar="LR",
        help=f"learning rate; repeat the flag or give a comma list (default {DEFAULT_LRS}). Every lr runs "
        "from the same initial weights and samples; the final summary line is for the FIRST lr given",
    )
    parser.add_argument("--plane", choices=PLANES, default="bf16", help="weight plane (default bf16)")
    parser.add_argument("--out", default=None, metavar="FILE.jsonl", help="write one JSON row per step and a summary per lr")
    parser.add_argument(
        "--bucket", default=None, metavar="DIR", help="local bucket directory (default: a temp dir, deleted after)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for sampling and advantages (default 0)")
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt (default 4; 4 prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="completion length cap (default 16)")
    parser.add_argument("--repeat", type=int, default=3, help="timed repeats per measurement, median taken (default 3)")
    parser.add_argument(
        "--init",
        choices=INITS,
        default="checkpoint",
        help="master weights at step 0: 'checkpoint' (default) as the trainer loads them; 'bf16' rounds them to "
        "bf16 first, as when the checkpoint is stored in bf16 (a diagnostic, see docs/weights.md)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch threads for sampling and the training step (default 1: on a shared 2-core machine two "
        "spinning threads are slower); PULSE encode/apply use their own threads",
    )


def parse_lrs(values: Sequence[str] | None) -> list[float]:
    """Learning rates from repeated ``--lr`` flags and/or comma lists, in the order given.

    Args:
        values: the raw flag values (None: the default ``1e-6,1e-5``).
    """
    out: list[float] = []
    for v in values or [DEFAULT_LRS]:
        for part in v.split(","):
            if part.strip():
                lr = float(part)
                if not lr > 0:
                    raise ValueError(f"learning rates must be > 0, got {part!r}")
                out.append(lr)
    if not out:
        raise ValueError("no learning rate given")
    return out


def timed_cpu(fn: Callable[[], T], repeat: int) -> tuple[float, float, T]:
    """Run ``fn`` ``repeat`` times; return the median wall time, the median process CPU time and the last result.

    CPU time counts every thread of this process, so on a machine shared with other work it shows what
    the work costs while wall time shows what it took.

    Args:
        fn: the work to time.
        repeat: how many runs (at least 1).
    """
    walls: list[float] = []
    cpus: list[float] = []
    result: T | None = None
    for _ in range(max(1, repeat)):
        c0, t0 = time.process_time(), time.perf_counter()
        result = fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    assert result is not None
    return statistics.median(walls), statistics.median(cpus), result


def timed(fn: Callable[[], T], repeat: int) -> tuple[float, T]:
    """Run ``fn`` ``repeat`` times; return the median wall time and the last result.

    Args:
        fn: the work to time.
        repeat: how many runs (at least 1).
    """
    wall, _, result = timed_cpu(fn, repeat)
    return wall, result


def states_identical(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    """Whether two states have the same names, dtypes, shapes and raw bytes.

    Args:
        a: a state.
        b: another state.
    """
    if set(a) != set(b):
        return False
    for k, x in a.items():
        y = b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not np.array_equal(np.ascontiguousarray(x).view(np.uint8), np.ascontiguousarray(y).view(np.uint8)):
            return False
    return True


def tensor_kind(name: str) -> str:
    """Coarse tensor group for breakdowns: embed, attn, mlp, norm or other.

    Args:
        name: parameter or state tensor name.
    """
    if "embed" in name or "lm_head" in name:
        return "embed"
    if "norm" in name:
        return "norm"
    if "attn" in name:
        return "attn"
    if "mlp" in name:
        return "mlp"
    return "other"


def count_changed(prev: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray]) -> dict[str, tuple[int, int]]:
    """Changed and total stored values per tensor kind (packed uint32 int8 codes count one per byte).

    Args:
        prev: state before.
        new: state after (same layout).
    """
    out: dict[str, tuple[int, int]] = {}
    for name, a in prev.items():
        b = new[name]
        if a.dtype == np.uint32:  # four int8 codes per word: count codes, not words
            a, b = a.view(np.uint8), b.view(np.uint8)
        c, n = out.get(tensor_kind(name), (0, 0))
        out[tensor_kind(name)] = (c + int(np.count_nonzero(a != b)), n + int(a.size))
    return out


def bf16_flip_model(before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray], lr: float) -> dict[str, float]:
    """Measured bf16 flips of one step next to three models of how many there should be.

    A bf16 value of magnitude in [2^k, 2^(k+1)) has spacing ``ulp = 2^(k-7)`` (relative 2^-8..2^-7). A
    master weight at a uniformly random point of its rounding cell that moves by ``d`` changes its bf16
    bits with probability ``min(1, d / ulp)``. ``uniform_lr`` uses ``d = lr`` (Adam moves every weight by
    about lr, whatever its gradient): only weight magnitudes and the lr enter. ``uniform_delta`` uses the
    measured per-weight ``|delta|``. ``position_lr`` drops the uniform assumption: the mean over weights
    of ``(flip(w + lr) + flip(w - lr)) / 2`` at their actual fp32 positions (a move of lr in a random
    direction). ``on_grid`` is the fraction of master weights exactly on a bf16 value (needs
    ``d >= ulp / 2`` to flip) and ``tie`` the fraction exactly halfway between two (any move away from
    the even neighbour flips it). Exact zeros count as flipping whenever they move.

    Args:
        before: fp32 master weights before the step.
        after: fp32 master weights after the step.
        lr: the step's learning rate.
    """
    n = 0
    sums = dict.fromkeys(("measured", "uniform_lr", "uniform_delta", "position_lr", "on_grid", "tie"), 0.0)
    ratio_sum = 0.0
    near_lr = 0
    chunk = 1 << 22
    step = np.float32(lr)
    for name, w0_all in before.items():
        f0, f1 = w0_all.reshape(-1), after[name].reshape(-1)
        for s in range(0, f0.size, chunk):
            w0, w1 = f0[s : s + chunk], f1[s : s + chunk]
            d = np.abs(w1.astype(np.float64) - w0.astype(np.float64))
            _, e = np.frexp(w0)
            ulp = np.ldexp(1.0, e.astype(np.int32) - 8)
            zero = w0 == 0
            p_lr = np.minimum(1.0, lr / ulp)
            p_d = np.minimum(1.0, d / ulp)
            p_lr[zero] = 1.0
            p_d[zero] = d[zero] > 0
            b0 = f32_to_bf16_bits(w0)
            low = w0.view(np.uint32) & np.uint32(0xFFFF)
            sums["measured"] += np.count_nonzero(b0 != f32_to_bf16_bits(w1))
            sums["uniform_lr"] += float(p_lr.sum())
            sums["uniform_delta"] += float(p_d.sum())
            sums["position_lr"] += 0.5 * (np.count_nonzero(f32_to_bf16_bits(w0 + step) != b0)
                                          + np.count_nonzero(f32_to_bf16_bits(w0 - step) != b0))
            sums["on_grid"] += np.count_nonzero(low == 0)
            sums["tie"] += np.count_nonzero(low == 0x8000)
            ratio_sum += float(d.sum()) / lr
            near_lr += int(np.count_nonzero(d >= 0.5 * lr))
            n += w0.size
    out = {k: float(v) / n for k, v in sums.items()}
    out["mean_abs_delta_over_lr"] = ratio_sum / n
    out["frac_delta_ge_half_lr"] = near_lr / n
    return out


def magnitude_quantiles(named: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Quantiles of |w| over all master weights (a 1-in-17 subsample) and the fraction of exact zeros.

    Args:
        named: fp32 master weights.
    """
    a = np.concatenate([np.abs(v.reshape(-1)[::17]) for v in named.values()])
    out = {f"q{int(q * 100):02d}": float(np.quantile(a, q)) for q in (0.01, 0.1, 0.5, 0.9)}
    out["zero"] = float(np.mean(a == 0))
    return out


class _Sampler:
    """Model-sampled completions and a GRPO-style policy-gradient step with random balanced advantages."""

    def __init__(self, model_dir: Path, samples: int, max_new_tokens: int, seed: int) -> None:
        from transformers import AutoTokenizer

        tok: Any = AutoTokenizer.from_pretrained(model_dir)
        self.eos = tok.eos_token_id
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else (self.eos if self.eos is not None else 0)
        self.prompts: list[list[int]] = []
        for text in PROMPTS:
            if getattr(tok, "chat_template", None):
                messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
                rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                ids = tok(rendered, add_special_tokens=False)["input_ids"]
            else:
                ids = tok(text)["input_ids"]
            self.prompts.append([int(i) for i in ids])
        self.samples = samples
        self.max_new_tokens = max_new_tokens
        self.seed = seed

    def step(self, policy: Any, opt: Any, step: int) -> dict[str, float]:
        """Sample completions from ``policy`` and take one AdamW step on the policy-gradient loss.

        Loss: ``-sum_i A_i * sum_t logp_it / n_tokens`` over all completions, where each group's
        advantages are a random permutation of half +1, half -1 (a GRPO group with random 0/1
        rewards, normalized). On-policy, so the PPO ratio is 1 and no clipping applies.

        Args:
            policy: a :class:`stoa.trainer.policy.Policy`.
            opt: its AdamW optimizer.
            step: step index (seeds sampling and advantages, so every lr sees the same first samples).
        """
        import torch

        from stoa.trainer.policy import pack

        t0 = time.perf_counter()
        rng = np.random.default_rng([self.seed, step])
        model = policy.model
        rows_p: list[np.ndarray] = []
        rows_c: list[np.ndarray] = []
        adv: list[float] = []
        model.eval()
        with torch.no_grad():
            for gi, p in enumerate(self.prompts):
                torch.manual_seed(self.seed * 1_000_003 + step * 1009 + gi)
                ids = torch.tensor([p] * self.samples, dtype=torch.long, device=policy.device)
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                     temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=self.max_new_tokens,
                                     pad_token_id=self.pad, use_cache=True)
                for row in out[:, len(p):].cpu().numpy():
                    cut = len(row)
                    if self.eos is not None and (hits := np.flatnonzero(row == self.eos)).size:
                        cut = int(hits[0]) + 1
                    rows_p.append(np.asarray(p, np.int64))
                    rows_c.append(row[: max(1, cut)].astype(np.int64))
                half = self.samples // 2
                adv.extend(rng.permutation([1.0] * half + [-1.0] * (self.samples - half)).tolist())
        model.train()
        t_sample = time.perf_counter() - t0
        t_max = max(len(c) for c in rows_c)
        batch = pack(rows_p, rows_c, t_max, policy.device)
        logp = policy.logprobs(batch)
        a = torch.tensor(adv, dtype=torch.float32, device=policy.device)
        loss = -(a[:, None] * logp).sum() / batch.mask.sum()
        loss.backward()
        params = [q for q in model.parameters() if q.grad is not None]
        gn = torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {
            "loss": float(loss.detach()),
            "grad_norm": float(gn),
            "tokens": float(batch.mask.sum()),
            "sample_s": t_sample,
            "train_step_s": time.perf_counter() - t0,
        }


def _copy(named: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.array(v, copy=True) for k, v in named.items()}


def _worker_at(bucket: Bucket, run_id: str, plane: str, version: int | None, state: State | None,
               s_hash: str | None) -> WeightSync:
    w = WeightSync(bucket, run_id, plane)
    w.version, w.state, w.state_hash = version, state, s_hash
    return w


def bench_lr(lr: float, args: argparse.Namespace, model_dir: Path, bucket: Bucket, sampler: _Sampler,
             emit: Callable[[dict[str, Any]], None], echo: Callable[[str], None]) -> dict[str, Any]:
    """Train ``args.steps`` AdamW steps at ``lr`` from the initial weights, publishing and syncing each version.

    Returns the summary row (medians over steps, catch-up timings); every step row goes to ``emit``.

    Args:
        lr: learning rate.
        args: parsed flags (model, steps, plane, repeat, ...).
        model_dir: the model directory.
        bucket: the local bucket both runs (patches and full anchors) are published to.
        sampler: prompts, sampling and the loss.
        emit: receives each JSONL row.
        echo: progress output.
    """
    import torch

    from stoa.trainer.policy import Policy

    plane, rep = args.plane, args.repeat
    tag = uuid.uuid4().hex[:8]
    run_id, full_run = f"pulse-{plane}-{tag}", f"pulse-{plane}-{tag}-full"
    t0 = time.perf_counter()
    policy = Policy(model_dir, torch.device("cpu"))
    if args.init == "bf16":
        policy.load_f32({k: bf16_bits_to_f32(f32_to_bf16_bits(v)) for k, v in policy.export_f32().items()})
    opt = torch.optim.AdamW(policy.model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    load_s = time.perf_counter() - t0
    publisher = WeightPublisher(bucket, run_id, plane, anchor_every=ANCHOR_EVERY)
    f32 = policy.export_f32()
    state = state_from_f32(f32, plane)
    first = publisher.publish(1, state)
    full_bf16_bytes = sum(2 * v.size for v in f32.values())
    state_bytes = sum(v.nbytes for v in state.values())
    mags = magnitude_quantiles(f32)
    # The worker one version behind, and the one that stays BEHIND versions behind for the catch-up test.
    worker = WeightSync(bucket, run_id, plane)
    w_version, w_state = worker.sync()
    w_hash = worker.state_hash
    bit_ok = states_identical(w_state, state) and w_hash == first.state_hash
    behind_at = max(1, args.steps + 1 - BEHIND)
    lagging: tuple[int, State, str | None] = (w_version, w_state, w_hash)
    rows: list[dict[str, Any]] = []
    # On CPU export_f32() returns views of the live parameters, so keep a copy of the pre-step weights.
    prev_state, prev_f32 = state, _copy(f32)
    for step in range(1, args.steps + 1):
        version = step + 1
        train = sampler.step(policy, opt, step)
        t = time.perf_counter()
        f32 = policy.export_f32()
        export_s = time.perf_counter() - t
        cast_s, state = timed(lambda f=f32: state_from_f32(f, plane), 1)
        trainer_hash = state_hash(state)
        pub = publisher.publish(version, state)
        patch = bucket.get(patch_key(run_id, version))
        info = read_patch_header(patch)
        encode_s, encode_cpu_s, again = timed_cpu(
            lambda p=prev_state, s=state, v=version: encode_patch(p, s, run_id=run_id, from_version=v - 1,
                                                                  to_version=v, plane=plane), rep)
        apply_s, apply_cpu_s, (applied, _) = timed_cpu(
            lambda p=prev_state, v=version, pt=patch: apply_patch(p, pt, run_id=run_id, expected_from_version=v - 1,
                                                                  plane=plane), rep)
        # A worker at the previous version syncs through the bucket (pointer, listing, patch, verify).
        sync_times: list[float] = []
        synced: State = {}
        new_hash: str | None = None
        path = ""
        for _ in range(max(1, rep)):
            w = _worker_at(bucket, run_id, plane, w_version, w_state, w_hash)
            t = time.perf_counter()
            _, synced = w.sync()
            sync_times.append(time.perf_counter() - t)
            new_hash, path = w.state_hash, w.metrics["path"]
        # Full-weight sync of the same version: an anchor in a second run, read by a fresh worker.
        full_pub = WeightPublisher(bucket, full_run, plane).publish(version, state)
        WeightPublisher(bucket, full_run, plane).gc(0)
        full_sync_s, (_, full_state) = timed(lambda: WeightSync(bucket, full_run, plane).sync(), rep)
        pointer = publisher.pointer
        identical = (
            pub.state_hash == trainer_hash
            and pointer is not None
            and pointer.state_hash == trainer_hash
            and info.state_hash == trainer_hash
            and new_hash == trainer_hash
            and path == "patches"
            and again == patch
            and states_identical(synced, state)
            and states_identical(applied, state)
            and states_identical(full_state, state)
            and full_pub.state_hash == trainer_hash
        )
        bit_ok = bit_ok and identical
        kinds = count_changed(prev_state, state)
        changed = sum(c for c, _ in kinds.values())
        values = sum(n for _, n in kinds.values())
        model = bf16_flip_model(prev_f32, f32, lr) if plane == "bf16" else {}
        sync_s = statistics.median(sync_times)
        row: dict[str, Any] = {
            "kind": "step", "model": args.model, "plane": plane, "lr": lr, "init": args.init, "step": step,
            "version": version,
            "params": pub.elements if plane == "bf16" else sum(v.size for v in f32.values()),
            "values": values, "changed_values": changed, "changed_frac": changed / values,
            "changed_frac_by_kind": {k: c / n for k, (c, n) in sorted(kinds.items())},
            "patch_positions": info.changed, "patch_bytes": pub.bytes_patch,
            "full_bytes": full_pub.bytes_anchor, "full_bf16_bytes": full_bf16_bytes,
            "ratio": full_pub.bytes_anchor / pub.bytes_patch, "state_bytes": state_bytes,
            "encode_s": encode_s, "encode_gbps": state_bytes / encode_s / 1e9,
            "apply_s": apply_s, "apply_gbps": state_bytes / apply_s / 1e9,
            "encode_apply_gbps": state_bytes / (encode_s + apply_s) / 1e9,
            "encode_cpu_s": encode_cpu_s, "apply_cpu_s": apply_cpu_s,
            "encode_apply_cpu_gbps": state_bytes / (encode_cpu_s + apply_cpu_s) / 1e9,
            "loadavg_1m": os.getloadavg()[0],
            "sync1_s": sync_s, "full_sync_s": full_sync_s, "publish_s": pub.seconds,
            "full_publish_s": full_pub.seconds, "export_s": export_s, "cast_s": cast_s,
            "threads": default_threads(), "bit_identical": identical, **train,
            **({"flip_model": model} if model else {}),
        }
        rows.append(row)
        emit(row)
        echo(f"  lr={lr:g} step {step}/{args.steps}: changed {100 * row['changed_frac']:.3f}%, patch "
             f"{pub.bytes_patch / 1e6:.2f} MB (x{row['ratio']:.1f}), encode {row['encode_gbps']:.2f} GB/s, "
             f"apply {row['apply_gbps']:.2f} GB/s, sync {sync_s:.2f} s, full sync {full_sync_s:.2f} s, "
             f"train step {train['train_step_s']:.1f} s, bit-identical {identical}")
        w_version, w_state, w_hash = version, synced, new_hash
        if version == behind_at:
            lagging = (w_version, w_state, w_hash)
        prev_state, prev_f32 = state, _copy(f32) if step < args.steps else f32
    # Catch-up: BEHIND versions behind by patches, a late joiner (anchor v1 + every patch), full sync.
    final = prev_state
    target = publisher.pointer
    assert target is not None

    def catch_up(make: Callable[[], WeightSync], expect: str) -> tuple[float, int, bool]:
        times, nbytes, ok = [], 0, True
        for _ in range(max(1, rep)):
            w = make()
            t = time.perf_counter()
            _, st = w.sync()
            times.append(time.perf_counter() - t)
            nbytes = int(w.metrics["bytes"])
            ok = ok and w.metrics["path"] == expect and w.state_hash == target.state_hash \
                and states_identical(st, final)
        return statistics.median(times), nbytes, ok

    lag_v, lag_state, lag_hash = lagging
    behind = args.steps + 1 - lag_v
    patches_s, patches_b, ok1 = catch_up(lambda: _worker_at(bucket, run_id, plane, lag_v, lag_state, lag_hash),
                                         "patches")
    join_s, join_b, ok2 = catch_up(lambda: WeightSync(bucket, run_id, plane), "anchor")
    full_s, full_b, ok3 = catch_up(lambda: WeightSync(bucket, full_run, plane), "anchor")
    bit_ok = bit_ok and ok1 and ok2 and ok3
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    mean_patch = statistics.fmean(r["patch_bytes"] for r in rows)
    full_bytes = rows[0]["full_bytes"]
    summary: dict[str, Any] = {
        "kind": "summary", "model": args.model, "plane": plane, "lr": lr, "steps": args.steps, "init": args.init,
        "params": rows[0]["params"], "state_bytes": state_bytes, "full_bytes": full_bytes,
        "full_bf16_bytes": full_bf16_bytes, "mean_patch_bytes": mean_patch, "ratio": full_bytes / mean_patch,
        "ratio_vs_bf16": full_bf16_bytes / mean_patch,
        "changed_frac": med("changed_frac"), "changed_frac_steps": [r["changed_frac"] for r in rows],
        "patch_bytes_steps": [r["patch_bytes"] for r in rows],
        "encode_gbps": med("encode_gbps"), "apply_gbps": med("apply_gbps"),
        "encode_apply_gbps": med("encode_apply_gbps"), "encode_s": med("encode_s"), "apply_s": med("apply_s"),
        "encode_cpu_s": med("encode_cpu_s"), "apply_cpu_s": med("apply_cpu_s"),
        "encode_apply_cpu_gbps": med("encode_apply_cpu_gbps"), "loadavg_1m": med("loadavg_1m"),
        "sync1_s": med("sync1_s"), "publish_s": med("publish_s"), "full_publish_s": med("full_publish_s"),
        "cast_s": med("cast_s"), "train_step_s": med("train_step_s"), "load_s": load_s,
        "catchup_behind": behind, "catchup_patches_s": patches_s, "catchup_patches_bytes": patches_b,
        "catchup_anchor_s": join_s, "catchup_anchor_bytes": join_b, "catchup_full_s": full_s,
        "catchup_full_bytes": full_b, "weight_magnitudes": mags, "threads": default_threads(),
        "repeat": rep, "bit_identical": bit_ok,
    }
    if plane == "bf16":
        summary["flip_model_steps"] = [r["flip_model"] for r in rows]
    emit(summary)
    del policy, opt
    return summary


def format_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """The per-lr table: sparsity, sizes, ratio, throughput, catch-up times and bit-exactness.

    Args:
        summaries: summary rows from :func:`bench_lr`.
    """
    head = ("lr", "plane", "sparsity %", "patch MB", "full MB", "ratio", "encode GB/s", "apply GB/s",
            "catch-up s (patches / anchor / full)", "bit_identical")
    lines: list[tuple[str, ...]] = [head]
    for s in summaries:
        lines.append((
            f"{s['lr']:g}", s["plane"], f"{100 * s['changed_frac']:.3f}", f"{s['mean_patch_bytes'] / 1e6:.2f}",
            f"{s['full_bytes'] / 1e6:.1f}", f"{s['ratio']:.1f}", f"{s['encode_gbps']:.2f}", f"{s['apply_gbps']:.2f}",
            f"{s['catchup_patches_s']:.2f} / {s['catchup_anchor_s']:.2f} / {s['catchup_full_s']:.2f}",
            str(s["bit_identical"]).lower(),
        ))
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in lines)


def _notes(summaries: Sequence[Mapping[str, Any]]) -> list[str]:
    out = []
    for s in summaries:
        out.append(
            f"lr={s['lr']:g}: patch MB per step {[round(b / 1e6, 2) for b in s['patch_bytes_steps']]}, changed % "
            f"{[round(100 * f, 3) for f in s['changed_frac_steps']]}; encode+apply {s['encode_apply_gbps']:.2f} GB/s "
            f"wall, {s['encode_apply_cpu_gbps']:.2f} GB per CPU-second (encode {s['encode_cpu_s']:.3f} + apply "
            f"{s['apply_cpu_s']:.3f} CPU-s for {s['state_bytes'] / 1e6:.0f} MB stored, {s['threads']} threads, "
            f"load average {s['loadavg_1m']:.1f}); catch-up bytes "
            f"{s['catchup_patches_bytes'] / 1e6:.1f} MB ({s['catchup_behind']} patches) / "
            f"{s['catchup_anchor_bytes'] / 1e6:.1f} MB (anchor + {s['steps']}) / {s['catchup_full_bytes'] / 1e6:.1f} MB; "
            f"WeightSync one version behind {s['sync1_s']:.2f} s; trainer publish {s['publish_s']:.2f} s (patch) vs "
            f"{s['full_publish_s']:.2f} s (anchor), state_from_f32 {s['cast_s']:.2f} s; train step "
            f"{s['train_step_s']:.1f} s"
        )
        for i, m in enumerate(s.get("flip_model_steps", []), start=1):
            out.append(
                f"  step {i}: bf16 flips {100 * m['measured']:.3f}%; models: uniform(|d|=lr) "
                f"{100 * m['uniform_lr']:.3f}%, uniform(measured |d|) {100 * m['uniform_delta']:.3f}%, "
                f"position(|d|=lr) {100 * m['position_lr']:.3f}%; mean |d|/lr {m['mean_abs_delta_over_lr']:.2f}; "
                f"masters before: on bf16 grid {100 * m['on_grid']:.1f}%, on a tie {100 * m['tie']:.2f}%"
            )
    return out


def main(args: argparse.Namespace) -> int:
    """Run the benchmark for every lr, print the table and end with the summary line of the first lr.

    Args:
        args: flags from :func:`add_arguments`.
    """
    import torch

    from stoa.models import resolve_model

    lrs = parse_lrs(args.lr)
    if args.steps < 1 or args.repeat < 1 or args.samples < 2 or args.torch_threads < 1:
        raise ValueError("need --steps >= 1, --repeat >= 1, --samples >= 2 and --torch-threads >= 1")
    echo: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    model_dir = resolve_model(args.model)
    sampler = _Sampler(model_dir, args.samples, args.max_new_tokens, args.seed)
    out = open(args.out, "w", encoding="utf-8") if args.out else None  # noqa: SIM115
    tmp = None if args.bucket else tempfile.mkdtemp(prefix="stoa-bench-pulse-")
    bucket = open_bucket(args.bucket or str(tmp))

    def emit(row: dict[str, Any]) -> None:
        if out is not None:
            out.write(json.dumps(row, sort_keys=True) + "\n")
            out.flush()

    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.torch_threads)
    try:
        summaries = []
        for lr in lrs:
            echo(f"[bench pulse] {args.model} plane {args.plane} lr {lr:g}: {args.steps} steps")
            summaries.append(bench_lr(lr, args, model_dir, bucket, sampler, emit, echo))
    finally:
        torch.set_num_threads(threads_before)
        if out is not None:
            out.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"PULSE weight-plane benchmark: {args.model}, plane {args.plane}, init {args.init}, {args.steps} AdamW "
          f"steps per lr; medians over steps, each timing the median of {args.repeat} runs; {default_threads()} "
          f"PULSE threads; local bucket; full = the plane's anchor")
    print(format_table(summaries))
    for line in _notes(summaries):
        print(line)
    first = summaries[0]
    goals = [
        (f"ratio >= 100 (lr {first['lr']:g})", first["ratio"] >= 100),
        ("encode + apply >= 1 GB/s", first["encode_apply_gbps"] >= 1.0),
        ("100% bit-identical (all lrs)", all(s["bit_identical"] for s in summaries)),
    ]
    print("goals: " + ", ".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in goals))
    print(f"ratio={first['ratio']:.1f} encode_gbps={first['encode_gbps']:.2f} apply_gbps={first['apply_gbps']:.2f} "
          f"bit_identical={str(first['bit_identical']).lower()}")
    return 0 if all(s["bit_identical"] for s in summaries) else 1
