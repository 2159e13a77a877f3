"""The follow-along evaluator: one more bucket client. It reads the contract, fetches the model files, rebuilds
each version's weights from anchor + patches (verified), evaluates the task's held-out split and writes
``eval/*`` rows (with ``version``) as metrics chunks with source ``eval``, flushed after every evaluation.

Each version is evaluated at most once, also across restarts: the versions already in the ``eval`` chunks are
skipped. Versions published while an evaluation ran are caught up in order through the patch chain, which is
bound to the pointer's state hash before anything is evaluated; weights that do not verify are never used.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stoa.bucket import Bucket, BucketError, ObjectNotFound, open_bucket
from stoa.config.base import TRACKERS, ConfigError, report_to_names
from stoa.contract import ContractMismatch, RunContract, RunNotFound, digest_hex, download_model_files
from stoa.engines import default_engine, make_engine
from stoa.engines.adapter import prepare_adapter
from stoa.episodes.evaluation import evaluate_heldout
from stoa.episodes.task_tools import open_task_tools
from stoa.evaluator.chain import ChainRefused, at_version, chain_hashes, rebase
from stoa.layout import contract_key
from stoa.lifecycle import read_status, write_heartbeat
from stoa.models import default_cache_dir, model_fingerprint
from stoa.tasks import get_task
from stoa.tasks.code import check_task_code, from_contract
from stoa.tasks.data import contract_refs, localize_contract_options
from stoa.tasks.multiturn import is_multiturn
from stoa.telemetry.metrics import BucketMetrics, MetricsWriter, default_log_dir, read_bucket_metrics
from stoa.telemetry.trackers import open_trackers
from stoa.tokenize import TextCodec
from stoa.weights.errors import SyncError
from stoa.weights.pointer import Pointer
from stoa.weights.signing import trusted_run_key
from stoa.weights.sync import WeightSync

SOURCE = "eval"
"""The metrics chunks' source (``runs/<run>/metrics/eval-<start>-<seq>.jsonl``)."""
MAX_VERSION = 2**53
"""Largest version an ``eval`` row may name (larger or negative ones are forged and ignored)."""
FINAL_ATTEMPTS = 3
"""After the run finished, give up on a final version whose weights were refused this many times in a row."""




@dataclass(frozen=True)
class EvalConfig:
    """Settings of ``stoa eval``.

    Args:
        bucket: bucket URL or local directory.
        run: run id.
        follow: keep evaluating new versions until the run finishes (else: the current version once).
        engine: ``auto`` (MLX on Apple silicon, else torch), ``torch`` or ``mlx``.
        n: held-out prompts per evaluation.
        k: multi-turn tasks: sampled episodes per prompt for ``eval/pass@k`` (1: greedy only).
        every: evaluate only versions divisible by this (and the run's final version).
        max_versions: stop after this many evaluations (0: no limit).
        backfill: a first evaluator (no ``eval`` rows yet) starts at the run's first version, not the current.
        max_new_tokens: decode cap per answer (per model turn); 0: the contract's.
        retriever: a search task's endpoint or index directory (default: the run's index from the bucket).
        poll_seconds: wait between looks at the pointer and the run's status.
        wait_seconds: how long to wait for the run's contract and model files (0: look once).
        heartbeat_seconds: how often ``evaluator.json`` is rewritten.
        threads: torch CPU threads (0: torch's default).
        device: torch device.
        dtype: compute dtype.
        log_dir: where the local metrics JSONL goes (default: beside a local bucket's metrics).
        report_to: trackers the ``eval/*`` rows also go to (``wandb``, ``tensorboard``; the run's W&B group).
    """

    bucket: str
    run: str
    follow: bool = False
    engine: str = "auto"
    n: int = 64
    k: int = 1
    every: int = 1
    max_versions: int = 0
    backfill: bool = False
    max_new_tokens: int = 0
    retriever: str = ""
    poll_seconds: float = 2.0
    wait_seconds: float = 0.0
    heartbeat_seconds: float = 30.0
    threads: int = 0
    device: str = "auto"
    dtype: str = "auto"
    log_dir: str = ""
    report_to: str = ""

    def __post_init__(self) -> None:
        for name in ("n", "k", "every"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be at least 1, got {getattr(self, name)}")
        for name in ("max_versions", "max_new_tokens", "threads", "poll_seconds", "wait_seconds"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be at least 0, got {getattr(self, name)}")
        unknown = [t for t in report_to_names(self.report_to) if t not in TRACKERS]
        if unknown:
            raise ConfigError("report_to", f"unknown tracker {unknown[0]!r}; choose from {', '.join(TRACKERS)}")
        if self.engine not in ("auto", "torch", "mlx"):
            raise ConfigError("engine", f"must be auto, torch or mlx, got {self.engine!r}")


@dataclass
class EvalSummary:
    """What a run of the evaluator did.

    Args:
        evaluated: versions evaluated by this process, in order.
        already: versions found in the ``eval`` chunks at start (skipped).
        finished: the run finished and its final version was handled.
        refused: weight syncs refused (damaged or missing objects).
        figures: per evaluated version, its figures (``accuracy``, ``n``, ...).
    """

    evaluated: list[int] = field(default_factory=list)
    already: list[int] = field(default_factory=list)
    finished: bool = False
    refused: int = 0
    figures: dict[int, dict[str, float]] = field(default_factory=dict)


@dataclass
class _Evaluator:
    """A set-up evaluator: bucket, contract, engine, codec, task, tools, weight sync, metrics, progress."""

    cfg: EvalConfig
    bucket: Bucket
    contract: RunContract
    engine: Any
    codec: Any
    task: Any
    tools: Any
    sync: WeightSync
    metrics: MetricsWriter
    done: set[int]
    summary: EvalSummary
    lo: int | None = None
    """Every version at or below this has been handled (evaluated, skipped or passed over)."""
    beat_at: float = 0.0
    failures: int = 0


def evaluated_versions(bucket: Bucket, run_id: str) -> set[int]:
    """Versions that already have an evaluation in the run's ``eval`` metrics chunks.

    The chunks are untrusted: lines that are not bounded rows are skipped (one warning per chunk), and only
    versions in ``[0, MAX_VERSION]`` count.

    Args:
        bucket: the run's bucket.
        run_id: the run.
    """
    return {v for r in read_bucket_metrics(bucket, run_id, source=SOURCE)
            if type(v := r.get("version")) is int and 0 <= v <= MAX_VERSION
            and isinstance(r.get("eval/accuracy"), int | float)}


def read_contract(bucket: Bucket, run_id: str, wait_s: float, poll_s: float, echo: Callable[[str], Any]) -> RunContract:
    """The run's contract, waiting up to ``wait_s`` for it.

    Args:
        bucket: the run's bucket.
        run_id: the run.
        wait_s: how long to wait (0: look once).
        poll_s: wait between looks.
        echo: where the waiting note goes.

    Raises:
        RunNotFound: still no contract after ``wait_s``.
    """
    deadline, noted = time.monotonic() + wait_s, False
    while True:
        try:
            return RunContract.from_json(bucket.get(contract_key(run_id)))
        except ObjectNotFound:
            if time.monotonic() >= deadline:
                raise RunNotFound(f"no run {run_id!r} in bucket {bucket.url} (no contract); check --run/--bucket, "
                                  "or start the trainer first (--wait-seconds to wait for it)") from None
            if not noted:
                echo(f"[eval] waiting for run {run_id!r} to appear in {bucket.url}")
                noted = True
            time.sleep(poll_s)


def run_evaluator(cfg: EvalConfig, echo: Callable[[str], Any] = print) -> EvalSummary:
    """Evaluate the run's current version once, or (``cfg.follow``) every new version until the run finishes.

    Args:
        cfg: the settings.
        echo: where progress lines go.

    Raises:
        RunNotFound: the run has no contract.
        SyncError: the weights could not be verified (without ``follow``, or the final version with it).
        ContractMismatch: the model files in the bucket do not match the contract.
    """
    ev = _set_up(cfg, echo)
    try:
        _loop(ev, echo)
    finally:
        ev.metrics.close()
        try:
            write_heartbeat(ev.bucket, cfg.run, max(ev.done, default=None), stopped=True)
        except BucketError:
            pass
    return ev.summary


def _set_up(cfg: EvalConfig, echo: Callable[[str], Any]) -> _Evaluator:
    """Open the bucket, read the contract and the done versions, fetch the model files, build the engine."""

    bucket = open_bucket(cfg.bucket, create=cfg.wait_seconds > 0)  # waiting: the trainer may not have started
    contract = read_contract(bucket, cfg.run, cfg.wait_seconds, cfg.poll_seconds or 1.0, echo)
    run_key = trusted_run_key(contract.run_key, bucket.url, cfg.run, echo=echo, who="eval")
    check_task_code(from_contract(contract.task_code))  # the run's plugin code, before importing any
    contract_refs(contract.task_id, contract.task_spec)  # task data by content address only, before any download
    done = evaluated_versions(bucket, cfg.run)
    dest = default_cache_dir() / "runs" / digest_hex(bucket.url.encode())[:12] / cfg.run / "eval-model"
    model_dir = download_model_files(bucket, cfg.run, dest, timeout_s=cfg.wait_seconds,
                                     poll_s=cfg.poll_seconds or 1.0, echo=echo)
    fp = model_fingerprint(model_dir)
    bad = [f"model.{k}" for k in ("config_hash", "tokenizer_hash", "architecture")
           if getattr(fp, k) != getattr(contract.model, k)]
    if bad:
        raise ContractMismatch(bad, f"model files of run {cfg.run!r} in {bucket.url} do not match its contract")
    name = default_engine() if cfg.engine == "auto" else cfg.engine
    engine = make_engine(name, model_dir, dtype=cfg.dtype, device=cfg.device, threads=cfg.threads,
                         plane=contract.plane)
    check = prepare_adapter(engine, name, bucket, contract, model_dir, echo)  # a LoRA run: base + adapters
    task = get_task(contract.task_id,
                    **localize_contract_options(bucket, cfg.run, contract.task_id, contract.task_spec))
    tools = (open_task_tools(task, cfg.retriever, role="eval", bucket=bucket, run_id=cfg.run,
                             spec=contract.retriever, note=echo).tools if is_multiturn(task) else None)
    sink = BucketMetrics(bucket, cfg.run, source=SOURCE, flush_rows=1 << 30, flush_seconds=float("inf"))
    log_dir = default_log_dir(cfg.bucket, cfg.run, cfg.log_dir)
    trackers = open_trackers(report_to_names(cfg.report_to), run_id=cfg.run, source=SOURCE, bucket=bucket,
                             log_dir=log_dir)
    metrics = MetricsWriter(log_dir / f"{SOURCE}.jsonl", SOURCE, sink, trackers=trackers)
    summary = EvalSummary(already=sorted(done))
    echo(f"[eval] run {cfg.run}: task {contract.task_id}, engine {name}, {cfg.n} held-out prompts"
         + (f", pass@{cfg.k}" if tools is not None and cfg.k > 1 else "")
         + (f", {len(done)} versions already evaluated" if done else ""))
    return _Evaluator(cfg, bucket, contract, engine, TextCodec(model_dir), task, tools,
                      WeightSync(bucket, cfg.run, contract.weight_plane, run_key=run_key, check=check), metrics, done,
                      summary)


def _loop(ev: _Evaluator, echo: Callable[[str], Any]) -> None:
    """Look at the run's status and pointer, evaluate what is due, until done (see :func:`run_evaluator`)."""
    cfg = ev.cfg
    while True:
        _beat(ev)
        try:
            status = read_status(ev.bucket, cfg.run)  # before the pointer: a finished status is then final
            ev.sync.poll()
        except (BucketError, SyncError) as e:
            if not cfg.follow:
                raise
            echo(f"[eval] could not read the run ({e}); retrying")
            time.sleep(cfg.poll_seconds)
            continue
        pointer = ev.sync.pointer
        finished = status is not None and status.state == "finished"
        if pointer is None:
            if not cfg.follow or finished:
                raise SyncError("no_pointer", f"run {cfg.run!r} has published no weights yet; try again later "
                                              "or use --follow")
            time.sleep(cfg.poll_seconds)
            continue
        final = finished and status is not None and status.version <= pointer.version
        try:
            _catch_up(ev, pointer, final, echo)
            ev.failures = 0
        except SyncError as e:
            ev.failures += 1
            ev.summary.refused += 1
            _report(ev, e, echo)
            if not cfg.follow or (final and ev.failures >= FINAL_ATTEMPTS):
                raise
            time.sleep(min(60.0, cfg.poll_seconds * 2 ** min(ev.failures, 6)))
            continue
        if cfg.max_versions and len(ev.summary.evaluated) >= cfg.max_versions:
            echo(f"[eval] evaluated {len(ev.summary.evaluated)} versions (--max-versions); exiting")
            return
        if not cfg.follow or final:
            if final:
                ev.summary.finished = True
                echo(f"[eval] run {cfg.run!r} finished at v{pointer.version}; evaluated "
                     f"{len(ev.summary.evaluated)} versions here, {len(ev.done)} in all; exiting")
            return
        time.sleep(cfg.poll_seconds)


def _due(ev: _Evaluator, pointer: Pointer, final: bool) -> list[int]:
    """Versions to evaluate now: not done, after ``ev.lo``, divisible by ``every`` (or final), within budget."""
    cfg, t = ev.cfg, pointer.version
    if ev.lo is None:  # a version past the pointer (a forged eval row) moves nothing
        ev.lo = max((v for v in ev.done if v <= t), default=0 if cfg.backfill else t - 1)
    if not cfg.follow:
        due = [t] if t not in ev.done else []
    else:
        due = [v for v in range(ev.lo + 1, t + 1)
               if v not in ev.done and (v % cfg.every == 0 or (final and v == t))]
    if cfg.max_versions:
        due = due[: max(0, cfg.max_versions - len(ev.summary.evaluated))]
    return due


def _catch_up(ev: _Evaluator, pointer: Pointer, final: bool, echo: Callable[[str], Any]) -> None:
    """Evaluate every due version up to the pointer, each with weights verified first.

    Intermediate versions get their hashes from the patch chain (:func:`chain_hashes`), bound to the pointer
    before any of them is evaluated; when the chain cannot be verified they are passed over with one line and
    only the pointer's version is evaluated.
    """
    due, t = _due(ev, pointer, final), pointer.version
    hashes: dict[int, str] = {t: pointer.state_hash}
    if any(v < t for v in due):
        try:
            rebase(ev.sync, due[0], pointer)
            hashes.update(chain_hashes(ev.sync, pointer))
        except ChainRefused as e:
            skipped = [v for v in due if v < t]
            echo(f"[eval] refused {e.key}: {e.error.reason} ({e.error.detail[:200]}); passing over "
                 f"v{skipped[0]}..v{skipped[-1]}, evaluating v{t} only")
            ev.summary.refused += 1
            due = [v for v in due if v == t]
    for v in due:
        target = pointer if v == t else at_version(pointer, v, hashes[v])
        version, state = ev.sync.sync(target)
        if version != v:  # the pointer moved under a retried sync: evaluate it on the next look
            break
        _evaluate(ev, v, state, echo)
    if ev.sync.version != t:
        ev.sync.sync(pointer)  # keep the held weights at the pointer: the next catch-up starts there
    ev.lo = t


def _evaluate(ev: _Evaluator, version: int, state: Any, echo: Callable[[str], Any]) -> None:
    """Load verified weights, evaluate the held-out split, log and flush one ``eval/*`` row."""
    cfg, contract = ev.cfg, ev.contract
    max_new = cfg.max_new_tokens or contract.sampling.max_new_tokens
    ev.engine.load_state(state, contract.weight_plane)
    figures = evaluate_heldout(ev.engine, ev.codec, ev.task, cfg.n, max_new, tools=ev.tools, k=cfg.k,
                               temperature=contract.sampling.temperature)
    ev.metrics.log({"version": version, **{f"eval/{k}": v for k, v in figures.items()}})
    if ev.metrics.sink is not None and not ev.metrics.sink.flush():
        echo(f"[eval] v{version}: uploading the eval row failed; it goes with the next flush")
    ev.done.add(version)
    ev.summary.evaluated.append(version)
    ev.summary.figures[version] = figures
    extra = (f", cover-EM {figures['cover_em']:.3f}, EM {figures['em']:.3f}, search rate "
             f"{figures.get('search_rate', 0.0):.2f}" if "cover_em" in figures else "")
    extra += f", pass@{cfg.k} {figures[f'pass@{cfg.k}']:.3f}" if f"pass@{cfg.k}" in figures else ""
    echo(f"[eval] v{version}: accuracy {figures['accuracy']:.3f}{extra} on {int(figures['n'])} held-out prompts "
         f"({figures['seconds']:.1f}s)")
    _beat(ev, force=True)


def _beat(ev: _Evaluator, force: bool = False) -> None:
    """Rewrite the heartbeat when due (a failed write only waits for the next one)."""
    now = time.monotonic()
    if force or now - ev.beat_at >= ev.cfg.heartbeat_seconds:
        try:
            write_heartbeat(ev.bucket, ev.cfg.run, max(ev.done, default=None))
            ev.beat_at = now
        except BucketError:
            pass


def _report(ev: _Evaluator, error: SyncError, echo: Callable[[str], Any]) -> None:
    """One line per refused object of the failed sync (or one for the failure)."""
    held = f"v{ev.sync.version}" if ev.sync.version is not None else "no weights"
    for r in ev.sync.refusals:
        echo(f"[eval] refused {r.key}: {r.reason} ({r.detail[:200]}) [{r.plan}]; nothing evaluated with it")
    if not ev.sync.refusals:
        echo(f"[eval] weight sync failed ({error}); holding {held}")
