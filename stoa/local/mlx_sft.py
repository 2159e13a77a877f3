"""The MLX backend's cold-start step (``MLXBackend.sft_step``): cross-entropy of the action tokens, on the
adapters, with the cold start's own AdamW (the RL optimizer is untouched)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map

from stoa.algorithms.inputs import action_tokens, pack_sft
from stoa.episodes.demo_rows import SftRow
from stoa.local.backend import SftResult

__all__ = ["sft_step"]


def sft_step(backend: Any, rows: Sequence[SftRow], micro: Sequence[np.ndarray], lr: float) -> SftResult:
    """One cold-start step on an ``MLXBackend``: the mean cross-entropy of the step's action tokens under the
    sampling temperature (as the torch backend and the fleet trainer), summed gradients over the micro-batches,
    clipped to ``grad_clip``, one AdamW step of ``backend.sft_opt`` (made on the first call).

    Args:
        backend: the MLX backend (``model``, ``cfg``, ``_logp``, ``_set_checkpointing``, ``sft_opt``).
        rows: the step's rows.
        micro: row indices per micro-batch.
        lr: the cold start's learning rate.
    """
    if backend.sft_opt is None:
        backend.sft_opt = optim.AdamW(learning_rate=lr, weight_decay=0.0, bias_correction=True)
        backend.sft_opt.init(backend.model.trainable_parameters())
    backend.sft_opt.learning_rate = lr
    total = max(action_tokens(rows), 1)

    def loss_of(ids: mx.array, pos: mx.array, targets: mx.array, mask: mx.array) -> mx.array:
        logp, _ = backend._logp(ids, pos, targets)
        return -(logp.astype(mx.float32) * mask).sum() / total

    value_and_grad = nn.value_and_grad(backend.model, loss_of)
    grads: Any = None
    loss_sum = 0.0
    backend._set_checkpointing(True)
    try:
        for idx in micro:
            pk = pack_sft([rows[int(i)] for i in idx])
            loss, g = value_and_grad(mx.array(pk.input_ids), mx.array(pk.pos), mx.array(pk.targets),
                                     mx.array(pk.mask))
            grads = g if grads is None else tree_map(mx.add, grads, g)
            mx.eval(grads, loss)
            loss_sum += float(loss.item())
    finally:
        backend._set_checkpointing(False)
    if backend.cfg.grad_clip > 0:
        grads, _ = optim.clip_grad_norm(grads, backend.cfg.grad_clip)
    backend.sft_opt.update(backend.model, grads)
    mx.eval(backend.model.trainable_parameters(), backend.sft_opt.state)
    return SftResult(loss_sum, action_tokens(rows))
