"""The worker loop: check the contract, sync weights, sample groups, upload one record per group."""

from __future__ import annotations

import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np

from stoa.bucket import PatientBucket, open_bucket
from stoa.config import WorkerConfig
from stoa.contract import ContractMismatch, RunContract, download_model_files, wait_for_contract
from stoa.engines import Engine, default_engine
from stoa.engines import make_engine as build_engine
from stoa.layout import rollout_key
from stoa.metrics import MetricsWriter, default_log_dir
from stoa.records import RolloutRecord, Sample


def worker_id(label: str) -> str:
    """A unique, key-safe worker id: the label (or host name) plus a random suffix.

    Args:
        label: user-given label, may be empty.
    """
    base = label or socket.gethostname()
    base = "".join(c if c.isalnum() or c in "-_." else "-" for c in base)[:40].strip("-.") or "worker"
    return f"{base}-{secrets.token_hex(3)}"


def check_model(model_dir: Path, contract: RunContract) -> None:
    """Refuse a model directory whose config or tokenizer differs from the contract, naming the field.

    Args:
        model_dir: the local model directory.
        contract: the run contract.
    """
    from stoa.models import model_fingerprint

    fp = model_fingerprint(model_dir)
    bad = [f"model.{k}" for k in ("config_hash", "tokenizer_hash", "architecture")
           if getattr(fp, k) != getattr(contract.model, k)]
    if bad:
        raise ContractMismatch(bad, f"model at {model_dir} does not match run {contract.run_id!r}")


def check_expectations(cfg: WorkerConfig, contract: RunContract) -> None:
    """Refuse to join a run whose plane or group size differs from what this worker was told.

    Args:
        cfg: worker config (``plane``/``n_samples`` empty or 0 mean "whatever the run says").
        contract: the run contract.
    """
    bad = []
    if cfg.plane and cfg.plane != contract.plane:
        bad.append("plane")
    if cfg.n_samples and cfg.n_samples != contract.n_samples:
        bad.append("n_samples")
    if bad:
        detail = ", ".join(f"{f}: worker {getattr(cfg, f)!r} vs run {getattr(contract, f)!r}" for f in bad)
        raise ContractMismatch(bad, detail)


def make_engine(name: str, model_dir: Path, cfg: WorkerConfig, plane: str = "bf16") -> Engine:
    """Build the generation engine.

    Args:
        name: ``torch`` or ``mlx``.
        model_dir: model directory (config + tokenizer; weights come from the bucket).
        cfg: worker config (device, threads, dtype).
        plane: the run's weight plane (``dtype="auto"`` uses it on the torch engine).
    """
    return build_engine(name, model_dir, dtype=cfg.dtype, device=cfg.device, threads=cfg.threads, plane=plane)


def run_worker(cfg: WorkerConfig, echo=print) -> dict[str, Any]:
    """Sample and upload groups until ``cfg.max_groups`` (or forever). Safe to kill at any moment.

    Args:
        cfg: validated worker config.
        echo: where progress lines go.

    Returns:
        a summary (groups, tokens, tokens/s, versions seen).
    """
    from stoa.tasks import get_task
    from stoa.tokenize import TextCodec
    from stoa.weights.follow import WeightFollower
    from stoa.weights.sync import WeightSync

    bucket = PatientBucket(open_bucket(cfg.bucket, retry_seconds=cfg.bucket_retry_seconds),
                           exit_on_outage=cfg.exit_on_outage, note=echo)
    wid = worker_id(cfg.name)
    contract = wait_for_contract(bucket, cfg.run, cfg.wait_seconds, echo=echo)
    check_expectations(cfg, contract)
    if cfg.model:
        model_dir = Path(cfg.model)
        check_model(model_dir, contract)
    else:
        model_dir = _fetch_model(bucket, cfg, contract, wid, echo)
    engine_name = default_engine() if cfg.engine == "auto" else cfg.engine
    engine = make_engine(engine_name, model_dir, cfg, contract.plane)
    codec = TextCodec(model_dir)
    task = get_task(contract.task_id, **dict(contract.task_spec))
    sync = WeightSync(bucket, cfg.run, contract.plane)
    follower = WeightFollower(sync, contract.staleness_bound, base_delay_s=cfg.poll_seconds)
    metrics = MetricsWriter(default_log_dir(cfg.bucket, cfg.run, cfg.log_dir) / f"worker-{wid}.jsonl", wid)
    version = _sync(follower, engine, contract, cfg, echo, metrics, current=None)
    adopted_at = _published_at(sync)
    rng = np.random.default_rng(None if cfg.seed < 0 else cfg.seed)
    gen = engine.make_generator(None if cfg.seed < 0 else cfg.seed)
    sp = contract.sampling
    fingerprint = contract.fingerprint()
    in_flight = cfg.groups_in_flight or _tier_groups(contract.n_samples)
    echo(f"[worker {wid}] engine {engine_name} ({engine.dtype_name}), run {cfg.run}, v{version}, n={contract.n_samples}, "
         f"{in_flight} groups in flight")
    seq, total_tokens, t_start = 0, 0, time.perf_counter()
    versions_seen = {version}
    while cfg.max_groups == 0 or seq < cfg.max_groups:
        new_version = _sync(follower, engine, contract, cfg, echo, metrics, current=version)
        if new_version != version:
            version, adopted_at = new_version, _published_at(sync)
        versions_seen.add(version)
        k = in_flight if cfg.max_groups == 0 else min(in_flight, cfg.max_groups - seq)
        prompts = [task.sample_train(rng) for _ in range(k)]
        prompt_ids = [codec.encode_prompt(p.messages) for p in prompts]
        t0 = time.perf_counter()
        groups, st = engine.generate(prompt_ids, contract.n_samples, max_new_tokens=sp.max_new_tokens,
                                     temperature=sp.temperature, top_p=sp.top_p, eos_ids=contract.model.eos_token_ids,
                                     generator=gen)
        gen_s = time.perf_counter() - t0
        for prompt, ids, comps in zip(prompts, prompt_ids, groups, strict=True):
            samples = [Sample(np.array(c.tokens, np.int32), np.array(c.logprobs, np.float32),
                              task.reward(prompt, codec.decode(c.tokens)), c.finish_reason) for c in comps]
            rec = RolloutRecord(worker_id=wid, seq=seq, policy_version=version, contract_fingerprint=fingerprint,
                                task_id=task.id, prompt_id=prompt.id, prompt_tokens=np.array(ids, np.int32),
                                samples=samples, sampling={"temperature": sp.temperature, "top_p": sp.top_p},
                                timings={"generate_s": gen_s / k}, created_at=time.time())
            bucket.put_create(rollout_key(cfg.run, version, wid, seq), rec.encode())
            seq += 1
            if adopted_at is not None:  # pointer advance -> first record at the new version
                metrics.log({"worker/adoption_latency_s": time.time() - adopted_at, "worker/version": version})
                adopted_at = None
            metrics.log({"worker/version": version, "worker/reward_mean": float(np.mean([s.reward for s in samples])),
                         "worker/tokens": sum(len(c.tokens) for c in comps)}, step=seq)
        total_tokens += st.new_tokens
        metrics.log({"worker/tokens_per_s": st.new_tokens / gen_s if gen_s else 0.0, "worker/prefill_s": st.prefill_s,
                     "worker/decode_s": st.decode_s, "worker/version": version})
    metrics.close()
    dt = time.perf_counter() - t_start
    return {"worker_id": wid, "groups": seq, "tokens": total_tokens, "tokens_per_s": total_tokens / dt if dt else 0.0,
            "versions": sorted(versions_seen)}


def _tier_groups(n_samples: int) -> int:
    """Groups in flight from the machine's memory tier (env overrides apply)."""
    from stoa.worker.tiers import choose_tier

    return choose_tier(n_samples=n_samples).groups_in_flight


def _published_at(sync) -> float | None:
    """Unix time the trainer published the version this worker just adopted (from the pointer)."""
    from datetime import datetime

    p = getattr(sync, "pointer", None)
    try:
        return datetime.fromisoformat(p.updated_at).timestamp() if p is not None else None
    except (AttributeError, TypeError, ValueError):
        return None


def _fetch_model(bucket, cfg: WorkerConfig, contract: RunContract, wid: str, echo) -> Path:
    """Download the run's model files, waiting (up to ``wait_seconds``) while they are missing or still
    being uploaded (a listing that does not yet match the contract's fingerprints)."""
    cache = Path(os.environ.get("STOA_CACHE", Path.home() / ".cache" / "stoa")) / "runs" / cfg.run / f"model-{wid}"
    deadline = time.monotonic() + cfg.wait_seconds
    while True:
        model_dir = download_model_files(bucket, cfg.run, cache, timeout_s=max(0.0, deadline - time.monotonic()),
                                         poll_s=cfg.poll_seconds, echo=echo)
        try:
            check_model(model_dir, contract)
            return model_dir
        except ContractMismatch as e:
            if time.monotonic() >= deadline:
                raise
            echo(f"[worker] model files in the bucket do not match the contract yet ({e}); waiting")
            time.sleep(cfg.poll_seconds)


def _sync(follower, engine, contract: RunContract, cfg: WorkerConfig, echo, metrics: MetricsWriter,
          current: int | None) -> int:
    """Adopt the newest verified weights, or keep the held ones while they stay usable.

    Never exits over a refused object or an unusable pointer: the held weights keep sampling while at
    most the contract's ``staleness_bound`` versions behind; beyond that (or before the first version)
    this waits, retrying with the follower's jittered backoff, until a sync succeeds. Only a run that
    publishes no pointer at all within ``wait_seconds`` raises TimeoutError.
    """
    deadline = time.monotonic() + cfg.wait_seconds
    paused_at: float | None = None
    while True:
        step = follower.step()
        _report_sync(step, follower, current, echo, metrics)
        if step.adopted is not None:
            version, state = step.adopted
            _load(engine, state, contract.plane)
            m = follower.sync.metrics
            metrics.log({"worker/version": version, "worker/sync_bytes": m["bytes"], "worker/sync_s": m["seconds"],
                         "worker/sync_path": m["path"], "worker/sync_versions_applied": m["versions_applied"],
                         "worker/paused": 0})
            echo(f"[worker] now at v{version} ({m['path']}, {m['bytes'] / 1e6:.2f} MB in {m['seconds']:.2f}s)")
            return version
        if step.usable and current is not None:
            return current
        if step.target is None and step.error is None:  # nothing published yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {contract.run_id!r} published no weights within {cfg.wait_seconds:.0f}s")
        elif paused_at is None:
            paused_at = time.monotonic()
            held = (f"v{current} is {step.target - current} versions behind the pointer (v{step.target})"
                    if current is not None and step.target is not None else "no verified weights yet")
            echo(f"[worker] paused: {held}; not sampling until a sync succeeds")
            metrics.log({"worker/paused": 1, "worker/version": current})
        time.sleep(step.retry_in or cfg.poll_seconds)


def _load(engine, state, plane: str) -> None:
    """Load verified stored bits into the engine."""
    engine.load_state(state, plane)


def _report_sync(step, follower, current: int | None, echo, metrics: MetricsWriter) -> None:
    """One log line and one metrics row per refused object (``worker/sync_refused`` counts them since start,
    ``worker/sync_error`` is the reason, ``worker/sync_key`` the object); one line for a failure without one."""
    keeping = f"keeping v{current}" if current is not None else "no weights yet"
    before = follower.refused_total - len(step.refusals)
    for i, r in enumerate(step.refusals, start=1):
        echo(f"[worker] refused {r.key}: {r.reason} ({r.detail[:200]}) [{r.plan}]; "
             + ("fell back" if step.adopted is not None else keeping))
        metrics.log({"worker/sync_refused": before + i, "worker/sync_error": r.reason,
                     "worker/sync_key": r.key, "worker/version": current})
    if step.error is not None and not step.refusals:
        echo(f"[worker] weight sync failed ({step.error}); {keeping}, retrying in {step.retry_in:.0f}s")
        metrics.log({"worker/sync_error": step.error.reason, "worker/version": current})
