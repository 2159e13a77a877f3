"""One shared step scenario, run alone (world size 1, in pytest) and under torchrun (2 gloo ranks on CPU).

``python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist/step_main.py MODEL_DIR OUT MODE``
writes rank 0's results to ``OUT`` (``.npz``); ``scenario`` returns them in-process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

TINY_VOCAB = 256


def entries(seed: int = 0):
    """Six groups of four samples, prompts and completions of varied lengths (an uneven split by tokens)."""
    from stoa.rollouts.records import RolloutRecord, Sample
    from stoa.trainer.pool import Entry

    rng = np.random.default_rng(seed)
    out = []
    for g in range(6):
        prompt = rng.integers(10, TINY_VOCAB, size=int(rng.integers(4, 14))).astype(np.int32)
        samples = []
        for _ in range(4):
            n = int(rng.integers(2, 12))
            samples.append(Sample(rng.integers(10, TINY_VOCAB, size=n).astype(np.int32),
                                  rng.uniform(-4.0, -0.5, size=n).astype(np.float32), float(rng.random()), "length"))
        rec = RolloutRecord("w", g, 1, "f", "bench", f"train:{g}", prompt, samples)
        out.append(Entry(f"k{g}", rec, np.array([s.reward for s in samples], np.float32)))
    return out


def fixed_weights(names_shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Deterministic weights to load and publish (the published-bits check)."""
    rng = np.random.default_rng(7)
    return {k: rng.standard_normal(s).astype(np.float32) * 0.05 for k, s in sorted(names_shapes.items())}


def scenario(model_dir: str, mode: str, dist=None) -> dict[str, np.ndarray]:
    """Two optimizer steps (KL on, clipping on) from the tiny model, then a load-and-export of fixed weights.

    Args:
        model_dir: the tiny model.
        mode: ``packed`` (micro-batches of 3 rows) or ``shared`` (one group per micro-batch), both without the
            recompute check (the logprobs are made up); ``checked``: packed, the check's limit at 150, which the
            made-up logprobs of 3 of the first step's 6 groups pass (groups split over micro-batches and ranks).
        dist: the ranks (None: alone).

    Returns:
        on rank 0: ``init/<name>``, ``step/<name>`` master weights before and after the steps, ``fixed/<name>``
        the exported fixed weights,
        ``loss`` and ``grad_norm`` of each step ({} on other ranks).
    """
    import torch

    from stoa.algorithms import AlgoConfig, get_algorithm
    from stoa.trainer.dist import SINGLE
    from stoa.trainer.policy import Policy
    from stoa.trainer.step import train_step

    dist = dist or SINGLE
    torch.manual_seed(0)
    dev = torch.device("cpu")
    policy = Policy(model_dir, dev, dist=dist)
    ref = Policy(model_dir, dev, trainable=False, dist=dist)
    algo = get_algorithm(AlgoConfig.from_dict({"name": "grpo", "kl_beta": 0.05}), "torch")
    # eps 1e-4: coordinates with a near-zero gradient would otherwise turn fp32 sum-order noise into whole steps
    opt = torch.optim.AdamW(policy.model.parameters(), lr=1e-2, eps=1e-4)
    start = {f"init/{k}": v.copy() for k, v in policy.export_f32().items()}
    limit = 150.0 if mode == "checked" else float("inf")
    ms = [train_step(policy, ref, opt, algo, entries(s), current_version=1, micro_batch=3, grad_clip=0.5,
                     shared_prefix=mode == "shared", dist=dist, recompute_limit=limit) for s in range(2)]
    stepped = policy.export_f32()
    out = {**start, **{f"step/{k}": v.copy() for k, v in stepped.items()}}
    shapes = {k: tuple(p.shape) for k, p in policy.named_parameters().items()}
    policy.load_f32(fixed_weights(shapes) if dist.main else None)
    out.update({f"fixed/{k}": v.copy() for k, v in policy.export_f32().items()})
    if dist.main:
        out["loss"] = np.array([m["loss"] for m in ms])
        out["grad_norm"] = np.array([m["grad_norm"] for m in ms])
        out["rejected"] = np.array([m.rejected.get("recompute", 0) for m in ms])
        out["judged"] = np.array([sorted(m.groups) for m in ms])  # provenance: every rank's groups on rank 0
        out["residual"] = np.array([[m.groups[g].residual for g in sorted(m.groups)] for m in ms])
        out["dropped"] = np.array([[m.groups[g].rejected for g in sorted(m.groups)] for m in ms])
    return out if dist.main else {}


if __name__ == "__main__":
    from stoa.trainer.dist import close_dist, init_dist

    ranks, _ = init_dist("cpu")
    try:
        result = scenario(sys.argv[1], sys.argv[3], ranks)
        if ranks.main:
            np.savez(Path(sys.argv[2]), **result)
    finally:
        close_dist(ranks)
