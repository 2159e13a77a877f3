"""The trainer loop: intake records, step, publish (pointer last), journal and checkpoint."""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

import numpy as np
import torch

from stoa.bucket import open_bucket
from stoa.config import TrainerConfig
from stoa.metrics import MetricsWriter, default_log_dir
from stoa.runfiles import upload_model_files
from stoa.trainer import checkpoint as ckpt
from stoa.trainer.policy import Policy
from stoa.trainer.pool import RecordPool
from stoa.trainer.setup import build_contract, ensure_contract, evaluate, reward_stats
from stoa.trainer.step import train_step

log = logging.getLogger("stoa.trainer")


class _Stop:
    """Turns SIGTERM/SIGINT into a graceful stop after the current step."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                signal.signal(sig, self._handle)
            except ValueError:  # not in the main thread
                pass

    def _handle(self, *_: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("stop requested: finishing the current step")


def run_trainer(cfg: TrainerConfig, echo=print) -> dict[str, Any]:
    """Run the trainer until ``cfg.steps`` steps were taken in this process (or forever).

    Args:
        cfg: validated trainer config.
        echo: where progress lines go.

    Returns:
        a summary (versions, evals, step times).
    """
    from stoa.algorithms import get_algorithm
    from stoa.models import resolve_model
    from stoa.tasks import get_task, parse_task_spec
    from stoa.tokenize import TextCodec
    from stoa.weights.planes import state_from_f32, state_to_f32
    from stoa.weights.store import WeightPublisher, WeightSync
    from stoa.worker.engine_torch import resolve_device

    stop = _Stop()
    torch.manual_seed(cfg.seed)
    bucket = open_bucket(cfg.bucket)
    name, opts = parse_task_spec(cfg.task)
    task = get_task(name, **opts)
    model_dir = resolve_model(cfg.model)
    codec = TextCodec(model_dir)
    device = resolve_device(cfg.device)
    policy = Policy(model_dir, device, temperature=cfg.temperature, gradient_checkpointing=cfg.gradient_checkpointing)
    contract = ensure_contract(bucket, build_contract(cfg, model_dir, task, codec, policy.vocab_size))
    upload_model_files(bucket, cfg.run, model_dir)
    algo = get_algorithm(cfg.algo_config(), "torch")
    ref = Policy(model_dir, device, temperature=cfg.temperature, trainable=False) if algo.cfg.kl_beta > 0 else None
    opt = torch.optim.AdamW(policy.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    publisher = WeightPublisher(bucket, cfg.run, cfg.plane, anchor_every=cfg.anchor_every)
    pool = RecordPool(bucket, contract, task, codec, staleness_bound=cfg.staleness_bound, reuse_cap=cfg.reuse_cap)
    metrics = MetricsWriter(default_log_dir(cfg.bucket, cfg.run, cfg.log_dir) / "trainer.jsonl", cfg.run)

    # Resume: continue after the newest published version; restore weights, optimizer and reuse counts.
    pointer = publisher.resume()
    restored = ckpt.load_checkpoint(bucket, cfg.run, policy.model, opt)
    journal = ckpt.read_journal(bucket, cfg.run) or {}
    pool.restore(journal.get("pool", {}))
    step = int(journal.get("step", restored.step if restored else 0))
    summary: dict[str, Any] = {"run": cfg.run, "evals": [], "step_times": []}
    if pointer is None:
        version = 1
        # Evaluate before publishing v1, so workers (which wait for v1) don't compete for the CPU.
        summary["evals"].append(_eval(policy, codec, task, cfg, version, metrics, echo, "before"))
        publisher.publish(version, state_from_f32(policy.export_f32(), cfg.plane))
        echo(f"[trainer] run {cfg.run}: published v1 ({contract.model.architecture}, plane {cfg.plane})")
    else:
        version = pointer.version
        if restored is None:  # crashed before the first checkpoint: keep the published weights
            _, published = WeightSync(bucket, cfg.run, cfg.plane).sync(pointer)
            policy.load_f32(state_to_f32(published, cfg.plane))
        echo(f"[trainer] resumed run {cfg.run} at v{version} (checkpoint v{restored.version if restored else '-'},"
             f" step {step})")

    steps_here, waited_since, last_wait_note = 0, time.monotonic(), 0.0
    last_step_at = time.monotonic()
    while not stop.requested and (cfg.steps == 0 or steps_here < cfg.steps):
        pool.refresh(version)
        if pool.available() < cfg.groups_per_step:
            idle = time.monotonic() - waited_since
            if cfg.max_wait_seconds and idle > cfg.max_wait_seconds:
                raise TimeoutError(f"no usable records for {idle:.0f}s (have {pool.available()} groups, "
                                   f"need {cfg.groups_per_step}); are workers running for run {cfg.run!r}?")
            if idle - last_wait_note > 30:
                echo(f"[trainer] v{version}: waiting for records ({pool.available()}/{cfg.groups_per_step} groups)")
                last_wait_note = idle
            time.sleep(cfg.poll_seconds)
            continue
        entries = pool.take(cfg.groups_per_step, keep=lambda r: bool(algo.keep_groups(r[None, :])[0]))
        if not entries:
            continue
        ckpt.write_journal(bucket, cfg.run, {"version": version + 1, "step": step + 1, "pool": pool.state()})
        m = train_step(policy, ref, opt, algo, entries, current_version=version,
                       micro_batch=cfg.micro_batch, grad_clip=cfg.grad_clip, shared_prefix=cfg.shared_prefix)
        version, step, steps_here = version + 1, step + 1, steps_here + 1
        t_pub = time.perf_counter()
        pub = publisher.publish(version, state_from_f32(policy.export_f32(), cfg.plane))
        publisher.gc(cfg.keep_versions)
        if step % cfg.checkpoint_every == 0:
            ckpt.save_checkpoint(bucket, cfg.run, policy.model, opt, version=version, step=step)
        rewards = np.stack([e.rewards for e in entries])
        lags = np.array([version - 1 - e.record.policy_version for e in entries])
        ps = pool.drain_stats()
        since, last_step_at = time.monotonic() - last_step_at, time.monotonic()
        row: dict[str, Any] = {f"train/{k}": v for k, v in m.items()}
        row.update({f"rollout/{k}": v for k, v in reward_stats(rewards).items()})
        row.update({"version": version, "train/publish_s": time.perf_counter() - t_pub,
                    "train/patch_bytes": float(getattr(pub, "bytes_patch", 0)),
                    "rollout/accepted": ps.accepted, "rollout/records_per_s": ps.accepted / since,
                    "rollout/sampled_tokens_per_s": ps.tokens / since, "rollout/dropped_stale": ps.dropped_stale,
                    "rollout/reward_mismatch": ps.reward_mismatch, "rollout/lag_mean": float(lags.mean()),
                    "rollout/lag_max": int(lags.max()), "rollout/reuse_mean": float(np.mean([e.uses for e in entries]))})
        row.update({f"rollout/rejected/{k}": v for k, v in ps.rejected.items()})
        row["rollout/filtered"] = ps.filtered
        row["rollout/keys"] = [e.key.rsplit("/", 2)[-2] + "/" + e.key.rsplit("/", 1)[-1] for e in entries]
        for lag in range(cfg.staleness_bound + 1):
            row[f"rollout/staleness/{lag}"] = int((lags == lag).sum())
        metrics.log(row, step=step)
        summary["step_times"].append(m["step_time_s"])
        echo(f"[trainer] step {step} -> v{version} | reward {row['rollout/reward_mean']:.3f} | "
             f"loss {m['loss']:+.4f} | kl {m.get('kl', 0.0):.2e} | {m['step_time_s']:.1f}s "
             f"({m['tokens_per_s']:.0f} tok/s) | lag {lags.mean():.1f} | records {ps.accepted / since:.2f}/s, "
             f"sampled {ps.tokens / since:.0f} tok/s")
        if cfg.eval_every and step % cfg.eval_every == 0:
            summary["evals"].append(_eval(policy, codec, task, cfg, version, metrics, echo, f"step {step}"))
        waited_since = time.monotonic()
    if steps_here and (not cfg.eval_every or step % cfg.eval_every):
        summary["evals"].append(_eval(policy, codec, task, cfg, version, metrics, echo, "after"))
    metrics.close()
    summary.update(version=version, step=step)
    return summary


def _eval(policy, codec, task, cfg: TrainerConfig, version: int, metrics: MetricsWriter, echo, label: str) -> dict:
    if cfg.eval_n == 0:
        return {}
    ev = evaluate(policy.model, codec, task, cfg.eval_n, cfg.max_new_tokens)
    metrics.log({"version": version, **{f"eval/{k}": v for k, v in ev.items()}})
    echo(f"[trainer] eval ({label}, v{version}): held-out accuracy {ev['accuracy']:.3f} on {int(ev['n'])} "
         f"prompts ({ev['seconds']:.1f}s)")
    return {"version": version, "label": label, **ev}
