"""The worker loop: check the contract, sync weights, sample groups, upload one record per group."""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from stoa.bucket import PatientBucket, open_bucket
from stoa.bucket.meter import METER
from stoa.config import WorkerConfig
from stoa.contract import ContractMismatch, RunContract, download_model_files, wait_for_contract
from stoa.engines import Completion, Engine, GenStats, default_engine
from stoa.engines import make_engine as build_engine
from stoa.engines.adapter import prepare_adapter
from stoa.episodes.collect import episode_sample, sample_episode_batch
from stoa.episodes.task_tools import open_task_tools
from stoa.identity import WorkerKey, load_worker_key, note_worker_key
from stoa.layout import rollout_key
from stoa.models import model_fingerprint
from stoa.rollouts.records import RolloutRecord, Sample
from stoa.tasks import get_task
from stoa.tasks.code import check_task_code, from_contract
from stoa.tasks.data import contract_refs, localize_contract_options
from stoa.tasks.multiturn import is_multiturn
from stoa.tasks.scoring import rewards_or_zeros
from stoa.telemetry.cost import report
from stoa.telemetry.metrics import BucketMetrics, MetricsWriter, default_log_dir
from stoa.telemetry.trackers import open_trackers
from stoa.tokenize import TextCodec
from stoa.weights.follow import WeightFollower
from stoa.weights.signing import trusted_run_key
from stoa.weights.sync import WeightSync
from stoa.worker.pacing import RunWatch, Verdict
from stoa.worker.syncing import published_at as _published_at
from stoa.worker.syncing import sync_weights as _sync
from stoa.worker.tiers import choose_tier

METRICS_FLUSH_ROWS = 200
"""A worker uploads its buffered metrics rows as a chunk once this many gathered ..."""
METRICS_FLUSH_SECONDS = 60.0
"""... or once the oldest is this old (and at exit); ``stoa status`` reads these chunks."""


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


def run_worker(cfg: WorkerConfig, echo: Callable[[str], Any] = print) -> dict[str, Any]:
    """Sample and upload groups until ``cfg.max_groups`` (or forever). Safe to kill at any moment.

    Set up (contract, model, engine), sync the first weights, then loop: follow the pointer, read the
    run's status (exit when the run is finished; pause while the trainer is stale or wants no more groups),
    sample a batch of groups, upload one record per group, log the batch.

    Args:
        cfg: validated worker config.
        echo: where progress lines go.

    Returns:
        a summary (groups, tokens, tokens/s, versions seen, whether the run finished).
    """
    w = _set_up(cfg, echo)
    version = _sync(w.follower, w.engine, w.contract, cfg, echo, w.metrics, current=None)
    seed = None if cfg.seed < 0 else cfg.seed
    p = _Progress(version=version, adopted_at=_published_at(w.sync), rng=np.random.default_rng(seed),
                  generator=w.engine.make_generator(seed),
                  in_flight=cfg.groups_in_flight or _tier_groups(w.contract.n_samples, w.engine_name, cfg.device))
    p.queue = episode_queue(w.engine, w.tools is not None, p.in_flight * w.contract.n_samples, cfg.episode_queue)
    queued = f" ({p.queue} batches of them queued on their decode slots)" if p.queue > 1 else ""
    echo(f"[worker {w.wid}] engine {w.engine_name} ({w.engine.dtype_name}), run {cfg.run}, v{version}, "
         f"n={w.contract.n_samples}, {p.in_flight} groups in flight{queued}")
    w.metrics.log({"worker/engine": w.engine_name, "worker/dtype": w.engine.dtype_name, "worker/version": version})
    t_start = time.perf_counter()
    p.versions_seen.add(version)
    finished = False
    try:  # the last metrics rows reach the bucket on a stop (Ctrl-C) or an error too
        while cfg.max_groups == 0 or p.seq < cfg.max_groups:
            _follow(w, p, echo)
            verdict = _watch(w, p, echo)
            if verdict.action == "exit":
                finished = True
                break
            if verdict.action == "pause":  # backpressure lifts as soon as the trainer steps: re-read sooner
                time.sleep(w.watch.pause_s(verdict, cfg.status_seconds if verdict.kind == "backpressure"
                                           else cfg.poll_seconds))
                continue
            k = p.in_flight * p.queue
            k = k if cfg.max_groups == 0 else min(k, cfg.max_groups - p.seq)
            k = w.watch.batch(k)  # no batch beyond this worker's share of what the trainer uses
            batch = _sample(w, p, k)
            if batch is None:
                time.sleep(cfg.poll_seconds)
                continue
            _upload(w, p, batch)
            w.watch.spend(len(batch.groups))  # the next batches sample for the share less these
            _log_batch(w, p, batch)
    finally:
        w.metrics.log(report(METER.counts()))  # the requests since the last record, for cost/* and stoa status
        w.metrics.close()
    dt = time.perf_counter() - t_start
    return {"worker_id": w.wid, "groups": p.seq, "tokens": p.total_tokens,
            "tokens_per_s": p.total_tokens / dt if dt else 0.0, "versions": sorted(p.versions_seen),
            "finished": finished, "paused_s": round(p.paused_s, 3)}


@dataclass
class _Worker:
    """A set-up worker: id, bucket, the run's contract, engine, codec, task, weight follower and metrics."""

    cfg: WorkerConfig
    wid: str
    bucket: PatientBucket
    contract: RunContract
    fingerprint: str
    engine_name: str
    engine: Engine
    codec: Any
    task: Any
    sync: Any
    """The ``WeightSync`` the follower drives (its pointer dates each adoption)."""
    follower: Any
    metrics: MetricsWriter
    watch: RunWatch
    """The run's status: finished, the trainer's heartbeat, the groups it still wants."""
    tools: Any = None
    """A multi-turn task's tools (``stoa.envs.Tools``); None for single-turn tasks."""
    key: WorkerKey | None = None
    """This worker's key (``worker_key``): it signs every record; None: records go unsigned."""


@dataclass
class _Progress:
    """Where the sampling loop stands: the version sampled from, its generators, groups and tokens so far."""

    version: int
    adopted_at: float | None
    """When the trainer published ``version``, until the first record at it is uploaded."""
    rng: np.random.Generator
    generator: Any
    in_flight: int
    queue: int = 1
    """Batches of ``in_flight`` groups sampled per call (``episode_queue``; 1 without decode slots)."""
    seq: int = 0
    total_tokens: int = 0
    versions_seen: set[int] = field(default_factory=set)
    paused: str = ""
    """Why sampling is paused (the verdict's kind), empty while sampling."""
    paused_since: float = 0.0
    paused_s: float = 0.0


class _Batch(NamedTuple):
    """One ``generate`` call: the prompts, their token ids, completions (or episodes) per group, engine
    figures, seconds; multi-turn batches also carry each episode's reward."""

    prompts: list[Any]
    prompt_ids: list[list[int]]
    groups: list[list[Completion]] | list[list[Any]]
    stats: GenStats
    seconds: float
    rewards: list[list[float]] | None = None


def _set_up(cfg: WorkerConfig, echo: Callable[[str], Any]) -> _Worker:
    """Open the bucket, wait for the run's contract, check it, get the model and build the engine.

    Args:
        cfg: validated worker config.
        echo: where progress lines go.
    """

    bucket = PatientBucket(open_bucket(cfg.bucket, retry_seconds=cfg.bucket_retry_seconds),
                           exit_on_outage=cfg.exit_on_outage, note=echo)
    key = load_worker_key(cfg.worker_key, cfg.run, cfg.name) if cfg.worker_key else None
    wid = worker_id(key.worker if key is not None else cfg.name)
    contract = wait_for_contract(bucket, cfg.run, cfg.wait_seconds, echo=echo)
    check_expectations(cfg, contract)
    run_key = trusted_run_key(contract.run_key, bucket.url, cfg.run, cfg.run_key_pub, echo)
    note_worker_key(bucket, cfg.run, run_key, key, echo)
    check_task_code(from_contract(contract.task_code))  # the run's plugin code, before importing any
    contract_refs(contract.task_id, contract.task_spec)  # task data by content address only, before any download
    if cfg.model:
        model_dir = Path(cfg.model)
        check_model(model_dir, contract)
    else:
        model_dir = _fetch_model(bucket, cfg, contract, wid, echo)
    engine_name = default_engine() if cfg.engine == "auto" else cfg.engine
    engine = make_engine(engine_name, model_dir, cfg, contract.plane)
    check = prepare_adapter(engine, engine_name, bucket, contract, model_dir, echo)  # a LoRA run: base + adapters
    codec = TextCodec(model_dir)
    task = get_task(contract.task_id,
                    **localize_contract_options(bucket, cfg.run, contract.task_id, contract.task_spec))
    sync = WeightSync(bucket, cfg.run, contract.weight_plane, run_key=run_key, check=check)
    follower = WeightFollower(sync, contract.staleness_bound, base_delay_s=cfg.poll_seconds)
    sink = BucketMetrics(bucket.inner, cfg.run, source=f"worker-{wid}", flush_rows=METRICS_FLUSH_ROWS,
                         flush_seconds=METRICS_FLUSH_SECONDS)  # the raw bucket: a failed upload never waits
    log_dir = default_log_dir(cfg.bucket, cfg.run, cfg.log_dir)
    trackers = open_trackers(cfg.report_to, run_id=cfg.run, source=f"worker-{wid}", bucket=bucket.inner,
                             log_dir=log_dir, config=cfg)
    metrics = MetricsWriter(log_dir / f"worker-{wid}.jsonl", wid, sink, trackers=trackers)
    watch = RunWatch(bucket, cfg.run, stale_s=cfg.trainer_stale_seconds, min_interval_s=cfg.status_seconds,
                     backpressure=cfg.backpressure, worker_id=wid, pacing=cfg.pacing,
                     staleness_bound=contract.staleness_bound)
    tools = None
    if is_multiturn(task):
        tools = open_task_tools(task, cfg.retriever, role="worker", bucket=bucket, run_id=cfg.run,
                                spec=contract.retriever, note=echo).tools
    return _Worker(cfg, wid, bucket, contract, contract.fingerprint(), engine_name, engine, codec, task, sync,
                   follower, metrics, watch, tools, key)



def _watch(w: _Worker, p: _Progress, echo: Callable[[str], Any]) -> Verdict:
    """Read the run's status (at most every ``status_seconds``); log each change between sampling and
    pausing once, with ``worker/paused`` (1 or 0) and ``worker/pause_reason``.

    Args:
        w: the worker.
        p: the loop's progress (its pause state).
        echo: where progress lines go.
    """
    v = w.watch.check()
    now = time.monotonic()
    if v.action == "exit":
        echo(f"[worker {w.wid}] {v.reason}; exiting")
    elif v.action == "pause" and p.paused != v.kind:
        if v.kind != "pacing":  # a gap between batches, every batch: metrics only
            echo(f"[worker {w.wid}] paused: {v.reason}")
        w.metrics.log({"worker/paused": 1, "worker/pause_reason": v.kind, "worker/version": p.version})
        p.paused_since = p.paused_since if p.paused else now
        p.paused = v.kind
    elif v.action == "sample" and p.paused:
        echo(f"[worker {w.wid}] resumed sampling ({p.paused} over after {now - p.paused_since:.0f}s)")
        w.metrics.log({"worker/paused": 0, "worker/version": p.version})
        p.paused_s += now - p.paused_since
        p.paused = ""
    return v


def _follow(w: _Worker, p: _Progress, echo: Callable[[str], Any]) -> None:
    """Adopt newer verified weights if there are any (or pause while the held ones are too old).

    Args:
        w: the worker.
        p: the loop's progress (its version and adoption time move on an adoption).
        echo: where progress lines go.
    """
    new_version = _sync(w.follower, w.engine, w.contract, w.cfg, echo, w.metrics, current=p.version)
    if new_version != p.version:
        p.version, p.adopted_at = new_version, _published_at(w.sync)
    p.versions_seen.add(p.version)


def _sample(w: _Worker, p: _Progress, k: int) -> _Batch | None:
    """Draw ``k`` training prompts and sample the contract's ``n_samples`` completions (or episodes) of each.

    Args:
        w: the worker.
        p: the loop's progress (prompt rng and sampling generator).
        k: groups to sample.

    Returns:
        the batch, or None when a multi-turn task's tools could not answer (nothing of it is uploaded).
    """
    sp = w.contract.sampling
    prompts = [w.task.sample_train(p.rng) for _ in range(k)]
    if w.tools is not None:
        eb = sample_episode_batch(w.engine, w.task, w.codec, w.tools, w.contract, prompts, p.generator, w.metrics)
        return None if eb is None else _Batch(eb.prompts, eb.prompt_tokens, eb.groups, eb.stats, eb.seconds,
                                              eb.rewards)
    prompt_ids = [w.codec.encode_prompt(q.messages) for q in prompts]
    t0 = time.perf_counter()
    groups, st = w.engine.generate(prompt_ids, w.contract.n_samples, max_new_tokens=sp.max_new_tokens,
                                   temperature=sp.temperature, top_p=sp.top_p,
                                   eos_ids=w.contract.model.eos_token_ids, generator=p.generator)
    return _Batch(prompts, prompt_ids, groups, st, time.perf_counter() - t0)


def _upload(w: _Worker, p: _Progress, batch: _Batch) -> None:
    """Score each group and upload it as one create-only record; log one metrics row per record.

    The first record at a newly adopted version also logs the adoption latency (publish to first record).

    Args:
        w: the worker.
        p: the loop's progress (``seq`` counts the records uploaded).
        batch: the sampled groups.
    """
    sp, task = w.contract.sampling, w.task
    for g, (prompt, ids, comps) in enumerate(zip(batch.prompts, batch.prompt_ids, batch.groups, strict=True)):
        if batch.rewards is not None:
            samples = [episode_sample(e, r) for e, r in zip(comps, batch.rewards[g], strict=True)]
        else:
            rewards = rewards_or_zeros(task, prompt, [w.codec.decode(c.tokens) for c in comps])
            samples = [Sample(np.array(c.tokens, np.int32), np.array(c.logprobs, np.float32), r, c.finish_reason)
                       for c, r in zip(comps, rewards, strict=True)]
        rec = RolloutRecord(worker_id=w.wid, seq=p.seq, policy_version=p.version,
                            contract_fingerprint=w.fingerprint, task_id=task.id, prompt_id=prompt.id,
                            prompt_tokens=np.array(ids, np.int32), samples=samples,
                            sampling={"temperature": sp.temperature, "top_p": sp.top_p},
                            timings={"generate_s": batch.seconds / len(batch.prompts), **report(METER.counts())},
                            created_at=time.time())
        key = rollout_key(w.cfg.run, p.version, w.wid, p.seq)
        w.bucket.put_create(key, rec.encode(sign=w.key.record_signer(key) if w.key is not None else None))
        p.seq += 1
        if p.adopted_at is not None:  # pointer advance -> first record at the new version
            w.metrics.log({"worker/adoption_latency_s": time.time() - p.adopted_at,
                           "worker/version": p.version})
            p.adopted_at = None
        w.metrics.log({"worker/version": p.version,
                       "worker/reward_mean": float(np.mean([s.reward for s in samples])),
                       "worker/tokens": sum(len(c.tokens) for c in comps), **report(METER.counts())}, step=p.seq)


def _log_batch(w: _Worker, p: _Progress, batch: _Batch) -> None:
    """Count the batch's tokens and log its throughput, prefill and decode times.

    Args:
        w: the worker.
        p: the loop's progress.
        batch: the sampled groups.
    """
    st = batch.stats
    p.total_tokens += st.new_tokens
    w.metrics.log({"worker/tokens_per_s": st.new_tokens / batch.seconds if batch.seconds else 0.0,
                   "worker/prefill_s": st.prefill_s, "worker/decode_s": st.decode_s,
                   "worker/version": p.version})


def episode_queue(engine: Any, multi_turn: bool, slots: int, queue: int) -> int:
    """Batches of groups in flight the worker samples per call: ``queue`` for a multi-turn task on an engine with
    decode slots (torch, MLX), whose ``decode_slots`` becomes ``slots`` (the rows of one batch: the queued episodes
    take the slots of those that end); 1 otherwise (single turns, or an engine without slots).

    Args:
        engine: the worker's engine.
        multi_turn: the task runs episodes (it has tools).
        slots: rows of one batch of groups in flight (groups x n).
        queue: the worker's ``episode_queue``.
    """
    if not multi_turn or queue <= 1 or not hasattr(engine, "decode_slots"):
        return 1
    engine.decode_slots = slots
    return queue


def _tier_groups(n_samples: int, engine: str, device: str) -> int:
    """Groups in flight from the memory tier of the engine's device (env overrides apply): on CUDA the GPU's
    free memory once the engine holds its weights, else the machine's RAM."""

    return choose_tier(n_samples=n_samples, engine=engine, device=device).groups_in_flight


def _fetch_model(bucket, cfg: WorkerConfig, contract: RunContract, wid: str, echo) -> Path:
    """Download the run's model files, waiting (up to ``wait_seconds``) while they are missing or still
    being uploaded (a listing that does not yet match the contract's fingerprints)."""
    root = Path(os.environ.get("STOA_CACHE", Path.home() / ".cache" / "stoa"))
    cache = root / "runs" / cfg.run / f"model-{wid}"
    deadline = time.monotonic() + cfg.wait_seconds
    while True:
        model_dir = download_model_files(bucket, cfg.run, cache,
                                         timeout_s=max(0.0, deadline - time.monotonic()),
                                         poll_s=cfg.poll_seconds, echo=echo)
        try:
            check_model(model_dir, contract)
            return model_dir
        except ContractMismatch as e:
            if time.monotonic() >= deadline:
                raise
            echo(f"[worker] model files in the bucket do not match the contract yet ({e}); waiting")
            time.sleep(cfg.poll_seconds)
