"""Where one ``train_step`` spends its time and memory: seconds and peak RSS per phase, and the resident parts.

Runs the shape of ``stoa bench trl`` (SmolLM2-135M, 8 prompts x 8, ~48 + 64 tokens, micro-batch 16, KL 0.001 with
the reference forward) in this process: one warm-up step, then ``--steps`` timed ones. Each phase (reference
forward, policy forward, loss, backward, clip, AdamW, refreshing the bf16 copy) is timed by wrapping the call; a
thread samples RSS every 2 ms and keeps each phase's highest. Usage::

    python benchmarks/step_profile.py --dtype bfloat16            # the bf16 compute copy
    python benchmarks/step_profile.py --dtype float32 --shared-prefix
"""

from __future__ import annotations

import argparse
import functools
import os
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from stoa.algorithms import AlgoConfig, get_algorithm
from stoa.bench.trainer import on_policy, policy_kwargs, synthetic_entries
from stoa.models import resolve_model
from stoa.trainer import step as step_mod
from stoa.trainer.policy import Policy

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_gb() -> float:
    """This process's resident set now, GB."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE / 1e9


class Phases:
    """Seconds per phase and the highest RSS seen while each phase ran (sampled on a thread)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.peak: dict[str, float] = defaultdict(float)
        self.now = "other"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.stop.wait(0.002):
            self.peak[self.now] = max(self.peak[self.now], rss_gb())

    def wrap(self, fn: Any, name: str) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            outer, self.now = self.now, name
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.cpu[name] += time.process_time() - c0
                self.peak[name] = max(self.peak[name], rss_gb())
                self.now = outer

        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.cpu.clear()
        self.peak.clear()


def tensor_gb(tensors: Any) -> float:
    """Bytes of distinct tensors, GB."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values()) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--compute-weights", default="bf16_copy", choices=("autocast", "bf16_copy"))
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--kl-beta", type=float, default=0.001)
    p.add_argument("--shared-prefix", action="store_true")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-lean", dest="lean", action="store_false", help="keep the norms' and SwiGLU's intermediates")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    base = rss_gb()
    model_dir, cpu = resolve_model(a.model), torch.device("cpu")
    kw = policy_kwargs(a.dtype, a.compute_weights)
    policy = Policy(model_dir, cpu, lean=a.lean, **kw)
    ref = Policy(model_dir, cpu, trainable=False, **kw) if a.kl_beta > 0 else None
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-6)
    algo = get_algorithm(AlgoConfig.from_dict({"name": "grpo", "kl_beta": a.kl_beta, "max_tokens": 64}), "torch")
    ph = Phases()
    loaded = rss_gb()
    for name in ("score", "group_score"):
        setattr(policy, name, ph.wrap(getattr(policy, name), "forward"))
        if ref is not None:
            setattr(ref, name, ph.wrap(getattr(ref, name), "ref forward"))
    algo.loss = ph.wrap(algo.loss, "loss")  # type: ignore[method-assign]
    torch.autograd.backward = ph.wrap(torch.autograd.backward, "backward")
    torch.nn.utils.clip_grad_norm_ = ph.wrap(torch.nn.utils.clip_grad_norm_, "clip")
    opt.step = ph.wrap(opt.step, "adamw")  # type: ignore[method-assign]
    policy.refresh_copy = ph.wrap(policy.refresh_copy, "refresh copy")  # type: ignore[method-assign]
    total = []
    for r in range(1 + a.steps):
        entries = on_policy(synthetic_entries(8, 8, 48, 64, policy.vocab_size, r), policy, 64)
        ph.reset()
        t0, c0 = time.perf_counter(), time.process_time()
        step_mod.train_step(policy, ref, opt, algo, entries, current_version=1, micro_batch=a.micro_batch,
                            grad_clip=1.0, shared_prefix=a.shared_prefix, recompute_limit=float("inf"))
        total.append(time.perf_counter() - t0)
        step_cpu = time.process_time() - c0
    ph.stop.set()
    print(f"{a.dtype} ({a.compute_weights if a.dtype == 'bfloat16' else 'fp32'}), "
          f"{'shared prefix' if a.shared_prefix else f'packed, micro-batch {a.micro_batch}'}, kl {a.kl_beta}, "
          f"{'lean' if a.lean else 'not lean'}; "
          f"step {total[-1]:.2f} s, {step_cpu:.1f} CPU s (warm-up {total[0]:.2f} s); load {os.getloadavg()[0]:.1f}")
    print("| phase | s | CPU s | peak RSS GB |\n| --- | ---: | ---: | ---: |")
    for name, s in sorted(ph.seconds.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {s:.2f} | {ph.cpu[name]:.1f} | {ph.peak[name]:.2f} |")
    print(f"| other (batch, packing, metrics) | {total[-1] - sum(ph.seconds.values()):.2f} | "
          f"{step_cpu - sum(ph.cpu.values()):.1f} | {ph.peak['other']:.2f} |")
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    parts = {"interpreter + torch + libraries": base, "after loading (policy + ref + copy)": loaded,
             "fp32 masters": tensor_gb(policy.model.parameters()),
             "bf16 copy": tensor_gb(policy.copy.copies) if policy.copy is not None else 0.0,
             "reference": tensor_gb(ref.model.parameters()) if ref is not None else 0.0,
             "AdamW moments": tensor_gb(state),
             "fp32 gradients (inside the step; freed after it)": tensor_gb(policy.trainable_parameters())}
    print("resident parts, GB: " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))


if __name__ == "__main__":
    main()
