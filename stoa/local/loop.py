"""The backend-agnostic local loop: sample groups, score them, one optimizer step; metrics, evals, save and
resume. Multi-turn tasks sample whole episodes with their tools (``stoa.episodes``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stoa.algorithms import Algorithm, get_algorithm
from stoa.algorithms.batch import Trajectory, filter_and_build, micro_batches
from stoa.config import config_to_toml
from stoa.config.local import LocalConfig, resolve_backend
from stoa.engines.mlx_blas import prepare_mlx_blas
from stoa.envs.base import Tools
from stoa.episodes.collect import collect_episodes
from stoa.episodes.evaluation import evaluate_episodes, greedy_figures
from stoa.episodes.task_tools import open_task_tools
from stoa.local import coldstart
from stoa.local import saved as ckpt
from stoa.local.backend import Backend, derive_seed
from stoa.local.preflight import episode_tokens, preflight
from stoa.local.smoke import check_only_adapters
from stoa.models import resolve_model
from stoa.models.shapes import shape_for, shape_from_dir
from stoa.stopflag import StopFlag
from stoa.tasks import Prompt, Task, load_task
from stoa.tasks.scoring import rewards_or_zeros
from stoa.telemetry.metrics import MetricsWriter, read_metrics
from stoa.telemetry.trackers import open_trackers
from stoa.tokenize import TextCodec

EVAL_BATCH = 32
"""Held-out prompts decoded together."""


def make_backend(cfg: LocalConfig, model_dir: Path) -> Backend:
    """Build the configured backend around ``model_dir`` (imports torch or mlx only now).

    Args:
        cfg: validated config.
        model_dir: the resolved model directory.
    """
    name = resolve_backend(cfg.backend)
    if name == "mlx":

        prepare_mlx_blas()  # before stoa.local.mlx_backend imports mlx.core (Linux: MKL, see stoa.engines.mlx_blas)
        from stoa.local.mlx_backend import MLXBackend

        return MLXBackend(cfg, model_dir)
    from stoa.local.torch_backend import TorchBackend

    return TorchBackend(cfg, model_dir)



def draw_prompts(task: Task, codec: Any, rng: np.random.Generator, count: int,
                 max_prompt_tokens: int) -> list[tuple[Prompt, list[int]]]:
    """``count`` training prompts with their token ids; prompts longer than the cap are redrawn.

    Args:
        task: the task.
        codec: ``TextCodec`` of the model.
        rng: the prompt sampler (its state is part of the saved state).
        count: prompts to draw.
        max_prompt_tokens: the cap.
    """
    out: list[tuple[Prompt, list[int]]] = []
    for _ in range(100 * count):
        p = task.sample_train(rng)
        ids = codec.encode_prompt(p.messages)
        if len(ids) <= max_prompt_tokens:
            out.append((p, ids))
            if len(out) == count:
                return out
    raise ValueError(f"max_prompt_tokens: fewer than {count} of {100 * count} drawn prompts fit in "
                     f"{max_prompt_tokens} tokens")


def collect_groups(backend: Backend, task: Task, codec: Any, prompts: Sequence[tuple[Prompt, list[int]]],
                   cfg: LocalConfig, seed: int) -> tuple[list[list[Trajectory]], dict[str, float]]:
    """Single-turn rollout: G completions per prompt, rewarded by the task.

    A multi-turn rollout (``stoa.episodes.collect.collect_episodes``) returns the same thing: trajectories whose
    ``action_mask`` is 0 on environment tokens; everything downstream (batch, old/ref logprobs, loss) is shared.

    Args:
        backend: the model.
        task: the task (rewards).
        codec: the tokenizer.
        prompts: (prompt, token ids) pairs.
        cfg: the run's config.
        seed: the sampling seed of this step.
    """
    t0 = time.perf_counter()
    groups, stats = backend.rollout([ids for _, ids in prompts], cfg.n_samples,
                                    max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                    top_p=cfg.top_p, eos_ids=codec.eos_ids, seed=seed)
    dt = time.perf_counter() - t0
    rewards = [rewards_or_zeros(task, p, [codec.decode(c.tokens) for c in group])
               for (p, _), group in zip(prompts, groups, strict=True)]
    trajs = [[Trajectory.single_turn(ids, c.tokens, c.logprobs, r, c.finish_reason)
              for c, r in zip(group, rs, strict=True)]
             for (_, ids), group, rs in zip(prompts, groups, rewards, strict=True)]
    return trajs, {"rollout_s": dt, "new_tokens": float(stats.new_tokens),
                   "tokens_per_s": stats.new_tokens / dt if dt > 0 else 0.0, "prefill_s": stats.prefill_s}


def rollout(backend: Backend, task: Task, codec: Any, cfg: LocalConfig, rng: np.random.Generator,
            step: int, tools: Tools | None = None) -> tuple[list[list[Trajectory]], dict[str, Any]]:
    """Draw ``groups_per_step`` prompts, sample ``n_samples`` completions (or episodes) each, score them.

    Args:
        backend: the model.
        task: the task.
        codec: the tokenizer.
        cfg: the run's config.
        rng: the prompt sampler.
        step: the index of this step (seeds its sampling).
        tools: a multi-turn task's tools (None: a single-turn task).

    Returns:
        (the groups, the ``rollout/*`` metrics; multi-turn adds search rate, turns, tool seconds, end reasons).
    """
    prompts = draw_prompts(task, codec, rng, cfg.groups_per_step, cfg.max_prompt_tokens)
    seed = derive_seed(cfg.seed, step)
    if tools is not None:
        groups, rs = collect_episodes(backend, task, codec, tools, prompts, cfg, seed)
    else:
        groups, rs = collect_groups(backend, task, codec, prompts, cfg, seed)
    rewards = np.array([[t.reward for t in g] for g in groups])
    lengths = np.array([[len(t.tokens) for t in g] for g in groups])
    row: dict[str, Any] = {f"rollout/{k}": v for k, v in rs.items()}
    row.update({"rollout/reward_mean": float(rewards.mean()), "rollout/reward_std": float(rewards.std()),
                "rollout/zero_variance_groups": float((rewards.std(axis=1) == 0).mean()),
                "rollout/completion_len": float(lengths.mean()),
                "rollout/stop_frac": float(np.mean([t.finish_reason == "stop" for g in groups for t in g]))})
    return groups, row


def train_step(backend: Backend, algo: Algorithm, groups: Sequence[Sequence[Trajectory]], cfg: LocalConfig,
               started: float, step: int = 0) -> dict[str, Any]:
    """The group filter and the batch, old (and reference) logprobs by full forward, the micro-batched update.

    Args:
        backend: the model.
        algo: the algorithm on the backend.
        groups: this step's groups.
        cfg: the run's config.
        started: ``time.perf_counter()`` when the step's rollout began (``train/step_s`` counts from it).
        step: the index of this step (the ECHO schedule reads it with ``cfg.steps``).

    Returns:
        the ``train/*`` metrics (``train/skipped`` when the filter dropped every group) and
        ``rollout/filtered_groups``.
    """
    batch, keep = filter_and_build(groups, algo)
    row: dict[str, Any] = {"rollout/filtered_groups": int((~keep).sum())}
    if batch is None:
        row["train/skipped"] = 1
        return row
    micro = micro_batches(len(batch), cfg.micro_batch)
    t1 = time.perf_counter()
    if cfg.old_logprobs == "forward":
        batch.old_logp = backend.logprobs(batch, micro)
    t2 = time.perf_counter()
    if algo.cfg.kl_beta > 0:
        batch.ref_logp = backend.ref_logprobs(batch, micro)
    t3 = time.perf_counter()
    alpha = algo.echo_coefficient(step, cfg.steps)
    m = backend.step(batch, micro, algo, alpha)
    t4 = time.perf_counter()
    assert batch.old_logp is not None  # the update fills it when it was not computed before
    gap = np.abs(batch.rollout_logp - batch.old_logp)[batch.mask > 0]
    row.update({f"train/{k}": v for k, v in m.items()})
    if batch.echo_mask.any():
        row["train/echo_alpha"] = alpha
    row.update({"train/old_logp_s": t2 - t1, "train/ref_logp_s": t3 - t2, "train/update_s": t4 - t3,
                "train/step_s": t4 - started, "train/peak_memory_mb": backend.peak_memory_mb(),
                "rollout/decode_vs_forward_logp_max": float(gap.max())})
    return row


def evaluate(backend: Backend, task: Task, codec: Any, cfg: LocalConfig, step: int,
             tools: Tools | None = None) -> dict[str, float]:
    """Greedy held-out accuracy and mean reward on the task's first ``eval_n`` held-out prompts; a multi-turn
    task's EM, cover-EM, search rate, turns and pass@k over ``eval_k`` episodes per prompt sampled at the run's
    temperature (``stoa.episodes.evaluation``, on the backend's own engine).

    Args:
        backend: the model.
        task: the task.
        codec: the tokenizer.
        cfg: the run's config.
        step: the step evaluated (seeds nothing: decoding is greedy).
        tools: a multi-turn task's tools (None: a single-turn task).
    """
    if tools is not None:
        t0 = time.perf_counter()
        with backend.sampling():
            ev = evaluate_episodes(backend.engine, task, codec, tools, cfg.eval_n, max_turn_tokens=cfg.max_new_tokens,
                                   k=cfg.eval_k, temperature=cfg.temperature)
        ev["seconds"] = time.perf_counter() - t0
        return {f"eval/{k}": float(v) for k, v in ev.items()}

    def decode(prompt_tokens: list[list[int]]) -> tuple[list[list[Any]], Any]:
        return backend.rollout(prompt_tokens, 1, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                               top_p=1.0, eos_ids=codec.eos_ids, seed=derive_seed(cfg.seed, step, 1), greedy=True)

    ev = greedy_figures(decode, codec, task, cfg.eval_n, EVAL_BATCH, reward=True)
    return {f"eval/{k}": ev[k] for k in ("accuracy", "reward_mean", "n", "seconds")}


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop rows logged after ``step`` (they belong to steps a crash lost; the resumed run redoes them)."""
    rows = read_metrics(path)
    if any(r.get("step", 0) > step for r in rows):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows if r.get("step", 0) <= step))



def run_local(cfg: LocalConfig, *, echo: Callable[[str], Any] = print,
              backend: Backend | None = None, task: Task | None = None) -> dict[str, Any]:
    """Train ``cfg.steps`` steps (resuming from ``output_dir`` when it holds a saved state).

    Order: config checks, the output directory's saved state and cold-start marker, the memory preflight (from
    config.json, before any weight loads), then the model; a new run with ``cold_start`` set trains it before
    the first RL step (``stoa.local.coldstart``). SIGINT/SIGTERM finish the current step, save and return; a second one
    interrupts.

    Args:
        cfg: validated config.
        echo: progress lines.
        backend: an already built backend (tests); default: built from the config.
        task: an already built task (tests); default: ``load_task(cfg.task)``.

    Returns:
        summary: steps, evals, wall time, the output directory.
    """
    return _LocalRun(cfg, echo, backend, task).run()


class _LocalRun:
    """One local run: its task, model, algorithm, output directory, metrics and counters."""

    def __init__(self, cfg: LocalConfig, echo: Callable[[str], Any], backend: Backend | None,
                 task: Task | None) -> None:

        self.cfg, self.echo, self.stop = cfg, echo, StopFlag()
        self.t_start = time.perf_counter()
        self.out = Path(cfg.output_dir)
        self.task = task if task is not None else load_task(cfg.task)
        self.saved = ckpt.find_latest(self.out)
        ckpt.check_resumable(cfg, self.saved)
        self.marker = coldstart.check_marker(self.out, self.saved is not None)
        model_dir = self.preflight()
        self.tools = open_task_tools(self.task, cfg.retriever, role="local", corpus="cached", note=echo).tools
        self.codec = TextCodec(model_dir)
        self.backend = backend or make_backend(cfg, model_dir)
        check_only_adapters(self.backend.summary)
        self.algo = get_algorithm(cfg.algo_config(), self.backend.name)
        self.rng, self.step = np.random.default_rng(cfg.seed), 0
        self.metrics: MetricsWriter
        self.summary: dict[str, Any] = {"output_dir": str(self.out), "evals": [], "step_times": []}

    def preflight(self) -> Path:
        """The memory preflight (from config.json when the model is known, before any weight loads);
        returns the model directory."""

        cfg = self.cfg
        total = episode_tokens(self.task)
        shape = shape_for(cfg.model)
        if shape is not None:
            self.echo(f"[local] preflight: {preflight(cfg, shape, total).message()}")
        model_dir = resolve_model(cfg.model)
        if shape is None:
            self.echo(f"[local] preflight: {preflight(cfg, shape_from_dir(model_dir, cfg.model), total).message()}")
        return model_dir

    def resume(self) -> None:
        """Continue from the output directory's saved state: adapters, optimizer, step, prompt sampler."""
        cfg, out = self.cfg, self.out
        out.mkdir(parents=True, exist_ok=True)
        if self.saved is not None:
            ckpt.restore(self.saved, self.backend)
            self.rng.bit_generator.state = self.saved.rng
            self.step = self.saved.step
            _truncate_metrics(out / "metrics.jsonl", self.step)
            self.echo(f"[local] resumed {out} at step {self.step}")
        (out / "config.toml").write_text(config_to_toml(cfg))
        self.metrics = MetricsWriter(out / "metrics.jsonl", run_name=out.name, trackers=open_trackers(
            cfg.report_to, run_id=out.name, source="local", log_dir=out, config=cfg))
        self.summary["start_step"] = self.step
        if self.marker is not None:  # a finished cold start: its figures, never the stage again
            self.summary["cold_start"] = {k: v for k, v in self.marker.items() if k != "state"}
        elif cfg.cold_start and self.saved is not None:
            self.echo(f"[local] cold_start skipped: {out} holds a run saved at step {self.step} without one")
        s = self.backend.summary
        self.echo(f"[local] {s.backend}: {cfg.model}, {s.layers} layers, {s.quant_bits}-bit base, "
                  f"{s.trainable_params:,} trainable of {s.total_params:,}; {cfg.algorithm}, "
                  f"G={cfg.n_samples}")

    def run(self) -> dict[str, Any]:
        """Set up, resume, then a loop of rollout -> step -> log -> save (and the periodic evaluations)."""
        cfg = self.cfg
        self.resume()
        last_saved = self.step
        with self.stop.installed():
            if self.saved is None:  # a new run: rows first (a bad file fails at once), "before", the cold start
                prepared = coldstart.prepare(cfg, self.task, self.codec, self.tools) if cfg.cold_start else None
                self.evaluate("before")
                if prepared is not None:
                    self.summary["cold_start"] = coldstart.run_stage(self, prepared)
            while self.step < cfg.steps and not self.stop.requested:
                started = time.perf_counter()
                groups, row = rollout(self.backend, self.task, self.codec, cfg, self.rng, self.step, self.tools)
                row.update(train_step(self.backend, self.algo, groups, cfg, started, self.step))
                self.step += 1
                self.log_step(row)
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                    last_saved = self.save()
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
                    self.evaluate(f"step {self.step}")
            if self.step != last_saved:
                self.save()
            if self.step >= cfg.steps and self.step > self.summary["start_step"]:
                self.evaluate("after")
                ckpt.write_adapters(self.out / "adapters", cfg, self.backend)
        self.metrics.close()
        self.summary.update(step=self.step, interrupted=self.stop.requested and self.step < cfg.steps,
                            wall_s=time.perf_counter() - self.t_start)
        return self.summary

    def log_step(self, row: dict[str, Any]) -> None:
        """Write the step's metrics row and its progress line."""
        self.metrics.log(row, step=self.step)
        self.summary["step_times"].append(row.get("train/step_s", row["rollout/rollout_s"]))
        turns = (f" | turns {row['rollout/turns_mean']:.2f}, search {row['rollout/search_rate']:.2f}"
                 if "rollout/turns_mean" in row else "")
        self.echo(f"[local] step {self.step}/{self.cfg.steps} | reward {row['rollout/reward_mean']:.3f}{turns} | "
                  f"loss {row.get('train/loss', 0.0):+.4f} | kl {row.get('train/kl', 0.0):.2e} | "
                  f"{row.get('train/step_s', 0.0):.2f}s ({row['rollout/tokens_per_s']:.0f} rollout tok/s)")

    def save(self) -> int:
        """Save the state (adapters, optimizer, step, prompt sampler); returns the step saved."""
        rng = dict(self.rng.bit_generator.state)
        ckpt.save_state(self.out, self.cfg, self.backend, step=self.step, rng=rng)
        return self.step

    def evaluate(self, label: str) -> dict[str, float] | None:
        """Greedy held-out evaluation (skipped when ``eval_n`` is 0), logged at the current step; its figures."""
        if self.cfg.eval_n == 0:
            return None
        ev = evaluate(self.backend, self.task, self.codec, self.cfg, self.step, self.tools)
        self.metrics.log(ev, step=self.step)
        self.summary["evals"].append({"step": self.step, "label": label, **ev})
        figures = (f"cover-EM {ev['eval/cover_em']:.3f}, EM {ev['eval/em']:.3f}, search rate "
                   f"{ev.get('eval/search_rate', 0.0):.2f}" if "eval/cover_em" in ev
                   else f"reward {ev['eval/reward_mean']:.3f}")
        self.echo(f"[local] eval ({label}, step {self.step}): accuracy {ev['eval/accuracy']:.3f}, {figures} on "
                  f"{int(ev['eval/n'])} held-out prompts ({ev['eval/seconds']:.1f}s)")
        return ev
