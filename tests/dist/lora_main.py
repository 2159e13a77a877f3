"""A LoRA policy's steps, run alone (in pytest) and under torchrun (2 gloo ranks on CPU, FSDP2).

``python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist/lora_main.py MODEL_DIR OUT BUCKET``
writes rank 0's results to ``OUT`` (``.npz``); ``scenario`` returns them in-process.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from tests.dist.step_main import entries


def scenario(model_dir: str, bucket_dir: str, dist=None) -> dict[str, np.ndarray]:
    """Two steps of a rank-4 adapter (KL off), its checkpoint saved and loaded into a fresh policy, a third step.

    Returns:
        on rank 0: ``merged/<name>`` the exported merged weights after two steps, ``adapter/<name>`` the adapter,
        ``loss`` of the three steps (the third after the reload) ({} on other ranks).
    """
    import torch

    from stoa.algorithms import AlgoConfig, get_algorithm
    from stoa.bucket import open_bucket
    from stoa.models.lora_torch import LoraSpec
    from stoa.trainer import checkpoint as ckpt
    from stoa.trainer.dist import SINGLE
    from stoa.trainer.lora import Identity
    from stoa.trainer.policy import Policy
    from stoa.trainer.step import train_step

    dist = dist or SINGLE
    dev, spec = torch.device("cpu"), LoraSpec(4, 8.0)
    algo = get_algorithm(AlgoConfig.from_dict({"name": "grpo", "kl_beta": 0.0}), "torch")

    def make(seed: int):
        pol = Policy(model_dir, dev, dist=dist, lora=spec, seed=seed)
        return pol, torch.optim.AdamW(pol.trainable_parameters(), lr=1e-2, eps=1e-4)

    def step(pol, opt, s: int) -> float:
        return float(train_step(pol, None, opt, algo, entries(s), current_version=1, micro_batch=3, grad_clip=0.5,
                                dist=dist, recompute_limit=float("inf")).get("loss", 0.0))

    pol, opt = make(0)
    losses = [step(pol, opt, s) for s in range(2)]
    out = {f"merged/{k}": v.copy() for k, v in pol.export_f32().items()}
    out.update({f"adapter/{k}": v for k, v in pol.adapter_f32().items()})
    bucket = open_bucket(bucket_dir)
    ident = Identity("base", spec, "tiny")
    ckpt.save_checkpoint(bucket, "r", pol.model, opt, version=3, step=2, dist=dist, echo=lambda s: None,
                         identity=ident)
    pol2, opt2 = make(5)
    ckpt.load_checkpoint(bucket, "r", pol2.model, opt2, dist, echo=lambda s: None, identity=ident)
    losses.append(step(pol2, opt2, 2))
    if dist.main:
        out["loss"] = np.array(losses)
    return out if dist.main else {}


if __name__ == "__main__":
    from stoa.trainer.dist import close_dist, init_dist

    ranks, _ = init_dist("cpu")
    try:
        result = scenario(sys.argv[1], sys.argv[3], ranks)
        if ranks.main:
            arrays: dict[str, Any] = dict(result)
            np.savez(Path(sys.argv[2]), **arrays)
    finally:
        close_dist(ranks)
