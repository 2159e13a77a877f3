"""What one forward of a loss needs, for every trainer: an RL micro-batch's ``LossInputs`` from the step's batch
(``micro_inputs``: the fleet trainer's step and both local-mode backends; ``to`` makes the backend's arrays), and
a cold-start micro-batch packed with its action tokens (``pack_sft``, ``action_tokens``: the trainer's
``stoa.trainer.coldstart`` and local mode's ``sft_step``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple, Protocol

import numpy as np

from stoa.algorithms.base import Algorithm, LossInputs
from stoa.algorithms.batch import Batch, Packed, pack_rows
from stoa.rollouts.episode import ROLE_ACTION


class RoleRow(Protocol):
    """A cold-start row (``stoa.episodes.demo_rows.SftRow``): a prompt, the tokens after it and their roles."""

    @property
    def prompt(self) -> np.ndarray: ...

    @property
    def tokens(self) -> np.ndarray: ...

    @property
    def roles(self) -> np.ndarray: ...


class EchoStep(NamedTuple):
    """How one step treats echo tokens (multi-turn ECHO), for every backend."""

    echo: bool
    """The batch has echo tokens: the loss gets the echo mask (``loss_echo``; the term itself when alpha > 0)."""
    alpha: float | None
    """This step's coefficient (``Algorithm.echo_coefficient``); None: the algorithm's constant one."""
    hits: bool
    """The ECHO term is on (alpha > 0): the forward also returns argmax hits (``echo_acc``)."""
    scored: np.ndarray
    """[B, T] float32: the positions the forward must score (actions, plus echo tokens when the batch has them)."""


def echo_step(batch: Batch, algo: Algorithm, alpha: float | None) -> EchoStep:
    """The echo settings of a step: none for single-turn rows (no echo tokens), hits only when the term is on.

    Args:
        batch: the step's batch.
        algo: the algorithm (its config's ``echo_alpha`` when ``alpha`` is None).
        alpha: this step's coefficient, or None for the algorithm's constant one.
    """
    if not batch.echo_mask.any():
        return EchoStep(False, alpha, False, batch.mask)
    on = (algo.cfg.echo_alpha if alpha is None else alpha) > 0
    return EchoStep(True, alpha, on, np.maximum(batch.mask, batch.echo_mask))


def micro_inputs(batch: Batch, idx: np.ndarray, logp: Any, *, to: Callable[[np.ndarray], Any],
                 stop: Callable[[Any], Any] | None = None, ref_logp: Any = None, echo: bool = False,
                 echo_alpha: float | None = None, hits: Any = None, keep: np.ndarray | None = None,
                 lags: bool = True) -> LossInputs[Any]:
    """The algorithm's inputs for the rows ``idx`` of ``batch``.

    The old policy is ``batch.old_logp`` (the workers' recorded logprobs, or a separate forward) or, when the batch
    has none, this forward's own logprobs under ``stop`` (on-policy, ratio 1). The reference is ``ref_logp`` or the
    batch's ``ref_logp`` rows. Per-token (GiGPO) advantages come along when the batch has them.

    Args:
        batch: the step's batch (its whole-batch normalisers).
        idx: the micro-batch's row indices.
        logp: [b, T] current-policy logprobs at the batch's width (with gradient).
        to: numpy -> backend array (device placement included).
        stop: stop-gradient of a backend array, for a batch without ``old_logp``.
        ref_logp: [b, T] reference logprobs computed for this micro-batch; None: ``batch.ref_logp`` rows (or none).
        echo: pass the echo mask (the batch has echo tokens).
        echo_alpha: this step's ECHO coefficient; None: the algorithm's constant one.
        hits: [b, T] argmax hits for the ECHO term, or None.
        keep: [b] 0/1: rows with 0 get empty masks (no loss: the recompute check rejected their group); None: all.
        lags: pass the rows' version lags (the per-lag diagnostics).

    Raises:
        ValueError: the batch has no ``old_logp`` and no ``stop`` was given.
    """
    def rows(a: np.ndarray) -> Any:
        return to(np.ascontiguousarray(a[idx]))

    def masked(a: np.ndarray) -> Any:
        return rows(a) if keep is None else to(np.ascontiguousarray(a[idx] * keep[:, None].astype(a.dtype)))

    if batch.old_logp is None and stop is None:
        raise ValueError("micro_inputs: the batch has no old_logp; pass stop= to use this forward's own logprobs")
    behaviour = stop(logp) if batch.old_logp is None and stop is not None else rows(batch.old_logp)  # type: ignore[arg-type]
    if ref_logp is None and batch.ref_logp is not None:
        ref_logp = rows(batch.ref_logp)
    return LossInputs(
        logp=logp, behaviour_logp=behaviour, ref_logp=ref_logp, advantages=rows(batch.advantages),
        mask=masked(batch.mask), normalizer=batch.normalizer, version_lag=batch.version_lag[idx] if lags else None,
        token_advantages=None if batch.token_advantages is None else rows(batch.token_advantages),
        echo_mask=masked(batch.echo_mask) if echo else None, echo_normalizer=batch.echo_normalizer,
        echo_alpha=echo_alpha, echo_hits=hits)


def action_tokens(rows: Sequence[RoleRow]) -> int:
    """How many action tokens (``ROLE_ACTION``) the rows hold: the normaliser of a cold-start step.

    Args:
        rows: the step's rows.
    """
    return int(sum(int((r.roles == ROLE_ACTION).sum()) for r in rows))


def pack_sft(rows: Sequence[RoleRow]) -> Packed:
    """One micro-batch of cold-start rows packed for a forward, its mask 1 on action tokens only (prompts and
    observations carry no loss).

    Args:
        rows: the micro-batch (each with at least one token after the prompt).
    """
    width = max(len(r.tokens) for r in rows)
    pk = pack_rows([r.prompt for r in rows], [r.tokens for r in rows], width)
    mask = np.zeros((len(rows), width), np.float32)
    for j, r in enumerate(rows):
        mask[j, : len(r.roles)] = r.roles == ROLE_ACTION
    return replace(pk, mask=mask)
