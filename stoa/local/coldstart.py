"""Local mode's cold start: supervised steps on demonstrations before the first RL step of a new run.

The same stage as the fleet trainer's (``stoa.trainer.coldstart``; local mode does not import the trainer):
``cold_start`` = ``demos`` (the task's own ``demonstrations``) or a JSONL file of conversations (TRL's
conversational format) becomes rows with ``stoa.episodes.demo_rows.build_rows``, and ``cold_start_steps``
AdamW steps of cross-entropy on the action tokens train the adapters (``Backend.sft_step``: the cold start's
own optimizer; RL then starts with fresh moments). A malformed line, or a demonstration of the file that cannot
be used, stops the run with one line naming the file and line before anything is trained.

Order in a new run: rows (so a bad file fails before any evaluation), evaluation "before", the ``started``
marker (``output_dir/cold_start.json``), the steps (``sft/*`` metrics at step 0, a progress line every eighth
of the steps), evaluation "cold start", a saved state at step 0 holding the cold-started adapters, then the
``done`` marker with the stage's figures. A resumed run never redoes it; a directory whose marker says
``started`` (stopped mid-stage), or ``done`` without a saved state, is refused with one line naming the fix.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from stoa.algorithms.batch import micro_batches
from stoa.config.local import LocalConfig
from stoa.envs.base import Tools
from stoa.episodes.demo_rows import Prepared, SftRow, prepare_rows
from stoa.local.backend import Backend
from stoa.tasks.demos import ColdStartError
from stoa.untrusted import load_object

__all__ = ["MARKER", "Prepared", "SftStep", "check_marker", "prepare", "read_marker", "run_stage", "sft_steps",
           "write_marker"]

MARKER = "cold_start.json"
"""The stage's marker in the output directory: ``{"state": "started" | "done", ...figures}``."""


def read_marker(out: Path) -> dict[str, Any] | None:
    """The output directory's cold-start marker, or None.

    Args:
        out: the run's output directory.
    """
    path = out / MARKER
    if not path.is_file():
        return None
    try:
        return load_object(path.read_bytes(), str(path), max_bytes=1 << 16)
    except ValueError as e:
        return {"state": f"unreadable: {str(e)[:120]}"}


def write_marker(out: Path, state: str, **figures: Any) -> None:
    """Write the marker atomically (temporary file, then rename).

    Args:
        out: the run's output directory.
        state: ``started`` or ``done``.
        **figures: what to record with it (source, examples, steps, losses, the "cold start" evaluation).
    """
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{MARKER}.tmp"
    tmp.write_text(json.dumps({"state": state, **figures}, sort_keys=True, indent=1))
    os.replace(tmp, out / MARKER)


def check_marker(out: Path, has_saved_state: bool) -> dict[str, Any] | None:
    """The marker of a finished cold start (None: none ran); refuse a directory whose stage did not finish.

    Args:
        out: the run's output directory.
        has_saved_state: whether it holds a saved state (a finished stage always leaves one, at step 0).

    Raises:
        SystemExit: the marker says ``started`` (stopped mid-stage), is unreadable, or says ``done`` with no
            saved state holding the cold-started adapters (one line naming the fix).
    """
    marker = read_marker(out)
    if marker is None or (marker.get("state") == "done" and has_saved_state):
        return marker
    why = "" if marker.get("state") != "done" else " but no saved state holds its adapters"
    raise SystemExit(f"stoa local train: {out}: its cold start did not finish ({out / MARKER} says "
                     f"{marker.get('state')!r}{why}); use another output_dir, or delete {out / MARKER} to run "
                     "the cold start again")


def prepare(cfg: LocalConfig, task: Any, codec: Any, tools: Tools | None) -> Prepared:
    """The rows of the run's ``cold_start`` setting (the task's demonstrations: unusable ones dropped; a file:
    the first unusable one stops it).

    Args:
        cfg: the run's config.
        task: the run's task.
        codec: the run's tokenizer.
        tools: the task's tools (None: a single-turn task).

    Raises:
        SystemExit: no demonstrations, a bad file line (names the file and line), or none usable.
    """
    try:
        return prepare_rows(cfg.cold_start, examples=cfg.cold_start_examples, seed=cfg.seed,
                            max_new_tokens=cfg.max_new_tokens, task=task, codec=codec, tools=tools)
    except ColdStartError as e:
        raise SystemExit(f"stoa local train: {e}") from None


class SftStep(NamedTuple):
    """One cold-start step's figures."""

    step: int
    """1-based step."""
    loss: float
    """Mean cross-entropy per action token (before the step's update)."""
    tokens: int
    """Action tokens trained on."""
    seconds: float
    """Wall time of the step."""


def sft_steps(backend: Backend, rows: Sequence[SftRow], cfg: LocalConfig,
              note: Callable[[SftStep], Any] | None = None,
              stop: Callable[[], bool] = lambda: False) -> list[SftStep]:
    """``cold_start_steps`` steps of ``Backend.sft_step``; each takes the next ``cold_start_batch`` rows of a
    seeded shuffle (reshuffled when it runs out), micro-batched by ``micro_batch``.

    Args:
        backend: the model.
        rows: the demonstrations' rows.
        cfg: the run's config (steps, batch, micro-batch, learning rate, seed).
        note: called with each step's figures as it ends (metrics and progress lines).
        stop: asked before each step; True ends the stage early (an interrupt: fewer steps are returned).
    """
    rng, order, at, out = np.random.default_rng(cfg.seed), np.array([], np.int64), 0, []
    lr = cfg.cold_start_lr or cfg.lr
    for step in range(1, cfg.cold_start_steps + 1):
        if stop():
            break
        t0 = time.perf_counter()
        if at + cfg.cold_start_batch > len(order):
            order, at = rng.permutation(len(rows)), 0
        picked = [rows[int(i)] for i in order[at : at + cfg.cold_start_batch]]
        at += cfg.cold_start_batch
        result = backend.sft_step(picked, micro_batches(len(picked), cfg.micro_batch), lr)
        out.append(SftStep(step, result.loss, result.tokens, time.perf_counter() - t0))
        if note is not None:
            note(out[-1])
    return out


def run_stage(run: Any, prepared: Prepared) -> dict[str, Any] | None:
    """Train the cold start in a new run (after its "before" evaluation): the ``started`` marker, the steps
    (``sft/*`` at step 0, a progress line every eighth), the "cold start" evaluation, a saved state at step 0,
    the ``done`` marker. Returns the figures recorded (``summary["cold_start"]``); None when a stop request
    ended it (mid-stage: the marker stays ``started`` and the directory is refused from then on; before it: no
    marker, nothing trained).

    Args:
        run: the local run (``cfg``, ``out``, ``backend``, ``metrics``, ``echo``, ``stop``, ``evaluate``,
            ``save``).
        prepared: ``prepare``'s rows and their description.
    """
    cfg, out, info = run.cfg, run.out, prepared.info
    n = cfg.cold_start_steps
    if run.stop.requested:  # stopped before the stage began: nothing trained, nothing marked
        return None
    write_marker(out, "started", **info)
    run.echo(f"[local] cold start: {n} steps on {info['examples']} demonstrations from {info['source']} "
             f"({info['dropped']} dropped)")
    every = max(1, n // 8)

    def note(f: SftStep) -> None:
        run.metrics.log({"sft/step": f.step, "sft/loss": f.loss, "sft/tokens": f.tokens, "sft/seconds": f.seconds},
                        step=0)
        if f.step % every == 0 or f.step == n:
            run.echo(f"[local] cold start step {f.step}/{n}: loss {f.loss:.3f} ({f.tokens} tokens, "
                     f"{f.seconds:.1f}s)")

    figures = sft_steps(run.backend, prepared.rows, cfg, note, stop=lambda: bool(run.stop.requested))
    if len(figures) < n:
        run.echo(f"[local] cold start stopped after {len(figures)}/{n} steps; nothing saved. {out} cannot resume: "
                 f"use another output_dir, or delete {out / MARKER} to run the cold start again")
        return None
    done = {**info, "steps": n, "loss_first": figures[0].loss, "loss_last": figures[-1].loss,
            "seconds": sum(f.seconds for f in figures)}
    run.echo(f"[local] cold start: loss {done['loss_first']:.3f} -> {done['loss_last']:.3f} in "
             f"{done['seconds']:.1f}s")
    done["eval"] = run.evaluate("cold start")
    run.save()
    write_marker(out, "done", **done)
    return done
