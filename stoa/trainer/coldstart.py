"""The cold start: supervised steps on demonstrations before a new run publishes v1.

A run with ``cold_start`` set (``demos``: the task's own ``demonstrations``; ``rft``: rejection sampling, the
initial policy's own correct samples of ``cold_start_rft_samples`` per training prompt, ``stoa.episodes.rft``;
a path: a JSONL file of conversations in TRL's conversational format) trains ``cold_start_steps`` AdamW steps
of next-token cross-entropy on the policy's own turns (``ROLE_ACTION``; prompts and observations carry no loss)
before the trainer publishes v1, so v1 holds the cold-started weights and RL continues from them.

Each demonstration becomes a row exactly as an episode would have it: the prompt rendered with the run's chat
template, each turn tokenised, each tool call run with the trainer's own tools and its observation built by the
task's environment and ``observation_tokens``. A JSONL line that is malformed, whose tool results differ from
the trainer's tools, or that exceeds the limits stops the stage with one line naming the file and line: nothing
is trained. The rows never pass through the rollout pool. The stage writes ``runs/<run>/trainer/cold_start.json``
(``started`` before the first step, ``done`` once v1 is published); a run whose marker says ``started`` and that
has no v1 was stopped mid-stage, and the trainer refuses to start RL on it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import torch

from stoa.algorithms.inputs import action_tokens, pack_sft
from stoa.algorithms.torch_loss import clip_and_step
from stoa.bucket import Bucket, ObjectNotFound
from stoa.engines.factory import engine_from_model
from stoa.engines.torch_scoring import to_device
from stoa.envs.base import Tools
from stoa.episodes.demo_rows import Prepared, SftRow, build_rows, prepare_rows
from stoa.episodes.rft import RftProgress, rejection_sample
from stoa.layout import run_prefix
from stoa.models import resolve_model
from stoa.tasks.demos import ColdStartError, load_conversations
from stoa.untrusted import load_object

__all__ = ["ColdStartError", "SftRow", "build_rows", "cold_start_key", "load_conversations", "prepare", "prepare_rft",
           "run_stage", "sft_loss", "sft_steps"]

def cold_start_key(run_id: str) -> str:
    """Key of the run's cold-start marker, ``runs/<run>/trainer/cold_start.json``.

    Args:
        run_id: the run.
    """
    return f"{run_prefix(run_id)}/trainer/cold_start.json"


def read_marker(bucket: Bucket, run_id: str) -> dict[str, Any] | None:
    """The run's cold-start marker (``state``: ``started`` or ``done``, and the stage's figures), or None.

    Args:
        bucket: the run's bucket.
        run_id: the run.
    """
    try:
        data = bucket.get(cold_start_key(run_id))
    except ObjectNotFound:
        return None
    return load_object(data, cold_start_key(run_id), max_bytes=1 << 16)


def write_marker(bucket: Bucket, run_id: str, state: str, **figures: Any) -> None:
    """Write the run's cold-start marker.

    Args:
        bucket: the run's bucket (lease-fenced).
        run_id: the run.
        state: ``started`` or ``done``.
        **figures: what to record with it (source, steps, losses).
    """
    bucket.put(cold_start_key(run_id), json.dumps({"state": state, **figures}, sort_keys=True).encode())


def sft_loss(policy: Any, rows: Sequence[SftRow]) -> tuple[torch.Tensor, int]:
    """Summed negative logprob of the rows' action tokens (one forward), and how many there are.

    Args:
        policy: the trainer's ``Policy`` (its forward: packed rows, logprobs at the masked positions).
        rows: the micro-batch.
    """
    pk = pack_sft(rows)  # local mode's sft_step packs with it too
    logp = policy.logprobs(to_device(pk, policy.device, pk.mask))
    return -logp.sum(), int(pk.mask.sum())


class SftStep(NamedTuple):
    """One cold-start step's figures."""

    step: int
    """1-based step."""
    loss: float
    """Mean cross-entropy per action token."""
    tokens: int
    """Action tokens trained on."""
    seconds: float
    """Wall time of the step."""


def sft_steps(policy: Any, rows: Sequence[SftRow], *, steps: int, batch: int, micro_batch: int, lr: float,
              grad_clip: float, seed: int, note: Callable[[SftStep], Any] | None = None) -> list[SftStep]:
    """``steps`` AdamW steps of cross-entropy on the rows' action tokens (its own optimizer); the figures.

    Each step takes the next ``batch`` rows of a seeded shuffle (reshuffled when it runs out), in micro-batches
    of ``micro_batch``; the loss is the mean over the step's action tokens.

    Args:
        policy: the trainer's ``Policy``.
        rows: the demonstrations' rows.
        steps: optimizer steps.
        batch: rows per step.
        micro_batch: rows per forward/backward (0: the whole step).
        lr: the learning rate.
        grad_clip: clip the global gradient norm to this (0: no clip).
        seed: the shuffle's seed.
        note: called with each step's figures as it ends (progress lines).
    """
    params = [p for p in policy.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    rng, order, at, out = np.random.default_rng(seed), np.array([], np.int64), 0, []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        if at + batch > len(order):
            order, at = rng.permutation(len(rows)), 0
        picked = [rows[int(i)] for i in order[at : at + batch]]
        at += batch
        total = action_tokens(picked)
        size = micro_batch or len(picked)
        loss_sum = 0.0
        for i in range(0, len(picked), size):
            loss, _n = sft_loss(policy, picked[i : i + size])
            (loss / max(total, 1)).backward()
            loss_sum += float(loss.detach())
        clip_and_step(params, opt, grad_clip)
        out.append(SftStep(step, loss_sum / max(total, 1), total, time.perf_counter() - t0))
        if note is not None:
            note(out[-1])
    return out


def prepare(cfg: Any, task: Any, codec: Any, tools: Tools | None) -> Prepared:
    """The rows of the run's ``cold_start`` setting.

    Args:
        cfg: the trainer config.
        task: the run's task.
        codec: the run's tokenizer.
        tools: the trainer's own tools (None: a single-turn task).

    Raises:
        ColdStartError: no demonstrations, a bad file line (names the file and line), or none usable.
    """
    if cfg.cold_start == "rft":
        raise ColdStartError("cold_start = rft samples from the policy: call prepare_rft with an engine")
    return prepare_rows(cfg.cold_start, examples=cfg.cold_start_examples, seed=cfg.seed,
                        max_new_tokens=cfg.max_new_tokens, task=task, codec=codec, tools=tools)


def prepare_rft(cfg: Any, task: Any, codec: Any, tools: Tools | None, engine: Any,
                note: Callable[[RftProgress], Any] | None = None) -> Prepared:
    """The rows of ``cold_start = "rft"``: the policy's own correct samples (``stoa.episodes.rft``), sampled at
    the run's temperature and top-p from training prompts drawn with the run's seed.

    Args:
        cfg: the trainer config (``cold_start_examples``, ``cold_start_rft_samples``, sampling settings).
        task: the run's task.
        codec: the run's tokenizer.
        tools: the trainer's own tools (None: a single-turn task).
        engine: the engine holding the initial policy.
        note: progress (kept, tried, prompts) after each engine call.

    Raises:
        ColdStartError: no sample was correct (names the fix).
    """
    t0 = time.perf_counter()
    got = rejection_sample(engine, task, codec, tools, examples=cfg.cold_start_examples,
                           samples=cfg.cold_start_rft_samples, max_new_tokens=cfg.max_new_tokens,
                           temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed, note=note)
    if not got.rows:
        raise ColdStartError(f"cold_start = rft: none of {got.tried} samples of {got.prompts} training prompts of "
                             f"task {task.id!r} was correct (nothing was trained); use cold_start = demos or a "
                             "JSONL file, or raise cold_start_rft_samples")
    return Prepared(got.rows, {"source": "rft", "examples": len(got.rows), "dropped": 0, "kept": len(got.rows),
                               "tried": got.tried, "prompts": got.prompts, "samples": cfg.cold_start_rft_samples,
                               "seconds": round(time.perf_counter() - t0, 3)})


@contextmanager
def sampling_engine(policy: Any, sharded: bool, export: Callable[[], dict[str, np.ndarray]], model_dir: Any,
                    dtype: str) -> Iterator[Any]:
    """An engine on the trainer's current weights, for rank 0 alone to sample from.

    One rank: the policy's own model (no copy; put back in train mode after). Sharded (``torchrun``): a rank
    cannot decode on its shard alone, so rank 0 loads the gathered full weights (``export``, which every rank
    joins) into a temporary engine on its device, freed after; the rows then go to every rank with the
    ``cold_start`` command (a broadcast).

    Args:
        policy: the trainer's ``Policy``.
        sharded: whether the model is sharded over several ranks.
        export: the full fp32 weights on rank 0 (every rank takes part).
        model_dir: the base model's directory (its config, for the temporary engine).
        dtype: the trainer's ``dtype`` setting.
    """
    from stoa.engines.torch import TorchEngine

    if not sharded:
        was_training = policy.model.training
        try:
            with policy.sampling():
                yield engine_from_model(policy.sampling_model())
        finally:
            policy.model.train(was_training)
        return
    engine = TorchEngine(model_dir, device=str(policy.device), dtype=dtype)
    engine.load_weights(export())
    try:
        yield engine
    finally:
        del engine


def _prepare(trainer: Any) -> Prepared:
    """The stage's rows for the trainer's ``cold_start`` setting (rft: sampled on rank 0, with progress lines)."""
    cfg, t = trainer.cfg, trainer
    if cfg.cold_start != "rft":
        return prepare(cfg, t.task, t.codec, t.tools.tools)

    def note(p: RftProgress) -> None:
        t.echo(f"[trainer] cold start rft: kept {p.kept}/{cfg.cold_start_examples} from {p.tried} samples of "
               f"{p.prompts} prompts")

    sharded = t.dist.sharded
    with sampling_engine(t.policy, sharded, lambda: t.ranks("export"), resolve_model(cfg.model) if sharded else None,
                         cfg.dtype) as engine:
        return prepare_rft(cfg, t.task, t.codec, t.tools.tools, engine, note)


def run_stage(trainer: Any) -> list[SftStep]:
    """Before a new run's v1: refuse a run whose cold start was interrupted, else train the cold start on every
    rank, record it (``started`` marker) and log ``sft/*``; [] when ``cold_start`` is off. The caller publishes
    v1 and then calls ``finish_stage``.

    Args:
        trainer: the trainer (``cfg``, ``bucket``, ``task``, ``codec``, ``tools``, ``ranks``, ``metrics``,
            ``fence``, ``echo``).

    Raises:
        SystemExit: an interrupted cold start, demonstrations that cannot be used, or (rft) no correct sample:
            one line naming the fix, before any marker is written or anything trained.
    """
    cfg, t = trainer.cfg, trainer
    if not cfg.cold_start:
        return []
    try:
        marker = read_marker(t.bucket, cfg.run)
    except ValueError as e:
        marker = {"state": f"unreadable: {str(e)[:120]}"}
    if marker is not None:
        raise SystemExit(f"stoa: run {cfg.run!r}: its cold start did not finish (marker {cold_start_key(cfg.run)} "
                         f"says {marker.get('state')!r} and no v1 was published); start a new run with another "
                         "--run, or delete that marker to run the cold start again")
    try:
        prepared = _prepare(t)
    except ColdStartError as e:
        raise SystemExit(f"stoa: {e}") from None
    t.fence()
    write_marker(t.bucket, cfg.run, "started", **prepared.info)
    info = prepared.info
    whence = (f"of the policy's own correct samples (rft: {info['kept']} kept of {info['tried']} samples)"
              if info["source"] == "rft" else f"demonstrations from {info['source']} ({info['dropped']} dropped)")
    t.echo(f"[trainer] cold start: {cfg.cold_start_steps} steps on {info['examples']} {whence}")
    if info["source"] == "rft":
        t.metrics.log({"sft/rft_kept": info["kept"], "sft/rft_tried": info["tried"], "sft/rft_prompts": info["prompts"],
                       "sft/rft_seconds": info["seconds"]})
    figures = t.ranks("cold_start", prepared.rows)  # the rows go to every rank (pickled, broadcast)
    for f in figures:
        t.metrics.log({"sft/step": f.step, "sft/loss": f.loss, "sft/tokens": f.tokens, "sft/seconds": f.seconds})
    t.echo(f"[trainer] cold start: loss {figures[0].loss:.3f} -> {figures[-1].loss:.3f} in "
           f"{sum(f.seconds for f in figures):.1f}s")
    t.cold_start_info = {**info, "steps": len(figures), "loss_first": figures[0].loss,
                         "loss_last": figures[-1].loss}
    return figures


def finish_stage(trainer: Any) -> None:
    """Mark the cold start ``done`` (after v1, which holds its weights, is published).

    Args:
        trainer: the trainer that ran ``run_stage``.
    """
    info = getattr(trainer, "cold_start_info", None)
    if info is not None:
        trainer.fence()
        write_marker(trainer.bucket, trainer.cfg.run, "done", **info)
