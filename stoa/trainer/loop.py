"""The trainer loop: intake records, step, publish (pointer last), journal and checkpoint."""

from __future__ import annotations

import time
from typing import Any

import torch

from stoa.bucket import BucketError, open_bucket
from stoa.bucket.meter import METER
from stoa.config import TrainerConfig
from stoa.episodes.task_tools import open_task_tools
from stoa.identity import IdentityBook, worker_keys_latch, worker_keys_wanted
from stoa.layout import checkpoint_key
from stoa.lifecycle import evaluator_present
from stoa.models import resolve_model
from stoa.stopflag import StopFlag
from stoa.tasks import get_task, parse_task_spec
from stoa.tasks.data import localize_options, portable_task_data
from stoa.telemetry.cost import CostClock, Prices
from stoa.telemetry.metrics import BucketMetrics, MetricsWriter, default_log_dir
from stoa.telemetry.trackers import open_trackers, sample_completions
from stoa.tokenize import TextCodec
from stoa.trainer import checkpoint as ckpt
from stoa.trainer import closing, coldstart
from stoa.trainer.cadence import CheckpointCadence
from stoa.trainer.demand import RolloutRetention, StatusPublisher, UniformSkips, poll_delay, wanted_groups
from stoa.trainer.dist import SINGLE, Dist
from stoa.trainer.lease import FencedBucket, Lease
from stoa.trainer.lora import publish_adapter_base
from stoa.trainer.overlap import Background, Done
from stoa.trainer.pool import Entry, RecordPool
from stoa.trainer.provenance import ProvenanceWriter, step_provenance
from stoa.trainer.quarantine import Quarantine
from stoa.trainer.ranks import Driver, RankOps, serve
from stoa.trainer.retry import RETRY_MAX_SLEEP_S, ride_out  # noqa: F401 - re-exported
from stoa.trainer.setup import build_contract, check_replay, ensure_contract
from stoa.trainer.step import entry_worker
from stoa.trainer.steplog import StepClock, step_line, step_row
from stoa.weights.adapter import adapter_state
from stoa.weights.errors import SyncError
from stoa.weights.planes import state_from_f32, state_to_f32
from stoa.weights.publish import WeightPublisher
from stoa.weights.signing import trainer_signer
from stoa.weights.sync import WeightSync

EVALUATOR_MAX_AGE_S = 90.0  # an evaluator beating this recently (every 30 s; clocks may differ) does the evals


def run_trainer(cfg: TrainerConfig, echo=print, take_over: bool = False) -> dict[str, Any]:
    """Run the trainer until the run has taken ``cfg.steps`` steps in total, restarts included (or forever).

    SIGINT/SIGTERM finish the current step (journal, publish, checkpoint) and return; a second one interrupts.
    The run's lease is taken first and released on the way out (see ``stoa.trainer.lease``).

    Args:
        cfg: validated trainer config.
        echo: where progress lines go.
        take_over: take the lease of a trainer whose heartbeat is older than ``cfg.lease_ttl_seconds``.

    Returns:
        a summary (versions, evals, step times).

    Raises:
        LeaseHeld: another live trainer holds the run.
        LeaseLost: another trainer took the run over while this one ran; nothing more was written.
    """
    from stoa.trainer.dist import close_dist, init_dist

    dist, device = init_dist(cfg.device)
    try:
        cfg = dist.broadcast(cfg)  # every rank runs rank 0's resolved config
        stop = StopFlag()
        with stop.installed():  # other ranks too: a signal ends the run through rank 0's stop, between steps
            if not dist.main:
                return _follow(cfg, dist, device, echo)
            trainer = _Trainer(cfg, echo, stop, take_over=take_over, dist=dist, device=device)
            try:
                return trainer.run()
            finally:
                trainer.close()
    finally:
        close_dist(dist)


def _follow(cfg: TrainerConfig, dist: Dist, device: torch.device, echo) -> dict[str, Any]:
    """A rank other than 0: build its shard of the model and run rank 0's commands until it says stop."""

    torch.manual_seed(cfg.seed)
    ops = RankOps(cfg, dist, device, resolve_model(cfg.model), open_bucket(cfg.bucket), echo)
    return {"run": cfg.run, "rank": dist.rank, "follower": True, "step": serve(ops), "version": None}


class _Trainer:
    """One trainer process: its model, optimizer, pool, publisher and counters."""

    def __init__(self, cfg: TrainerConfig, echo, stop: StopFlag | None = None, take_over: bool = False,
                 dist: Dist = SINGLE, device: torch.device | None = None) -> None:
        """Take the run's lease (before any write), then build the model, contract, optimizer and pool.

        Args:
            cfg: validated trainer config.
            echo: where progress lines go.
            stop: the SIGINT/SIGTERM flag.
            take_over: take a lease whose heartbeat is older than ``cfg.lease_ttl_seconds``.
            dist: the trainer's ranks (this is rank 0).
            device: this rank's device (default: ``cfg.device`` resolved).

        Raises:
            LeaseHeld: another live trainer holds the run (nothing was written).
        """
        self.cfg, self.echo, self.stop, self.dist = cfg, echo, stop or StopFlag(), dist
        raw = open_bucket(cfg.bucket)
        self.lease = Lease(raw, cfg.run, cfg.lease_ttl_seconds, model=cfg.model, echo=echo)
        ride_out(lambda: self.lease.acquire(take_over), "the lease", echo)
        self.bucket = FencedBucket(raw, self.lease)  # every write checks the lease first
        self.lease.start_heartbeat()
        try:
            self._build(cfg, device)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Wait for a checkpoint write still in flight, then release the lease (a lost one stays with its new
        holder); the next trainer starts at once."""
        if hasattr(self, "ops"):
            self.settle_checkpoint(failing=True)
        self.lease.release()

    def _build(self, cfg: TrainerConfig, device: torch.device | None) -> None:
        from stoa.engines.torch import resolve_device

        signer = trainer_signer(self.bucket, self.bucket.url, cfg.run, cfg.sign_weights, cfg.run_key, self.echo)
        run_key = signer.public_hex if signer is not None else ""
        keys_on = worker_keys_wanted(cfg.worker_keys, self.bucket.url, cfg.run, run_key, self.echo, bucket=self.bucket,
                                     latch=worker_keys_latch(signer.path) if signer is not None else None)
        torch.manual_seed(cfg.seed)
        name, opts = parse_task_spec(cfg.task)
        self.task = get_task(name, **localize_options(self.bucket, cfg.run, name, opts))  # a resumed run's data
        trust = check_replay(cfg.replay, self.task)
        if trust:
            self.echo(f"[trainer] {trust}")
        model_dir = resolve_model(cfg.model)
        self.codec = TextCodec(model_dir)
        self.ops = RankOps(cfg, self.dist, device or resolve_device(cfg.device), model_dir, self.bucket, self.echo)
        self.ranks = Driver(self.ops)  # the model side, on every rank together
        self.policy, self.ref, self.opt, self.algo = self.ops.policy, self.ops.ref, self.ops.opt, self.ops.algo
        self.tools = open_task_tools(self.task, cfg.retriever, role="trainer", bucket=self.bucket, run_id=cfg.run,
                                     publish=True, corpus="cached", note=self.echo)
        data = portable_task_data(self.task)  # its files go up before the contract, which names them by digest
        adapter = None
        if self.policy.lora is not None:  # a LoRA run's base goes up once, before the contract; the trainer then
            base = publish_adapter_base(self.bucket, cfg, self.ops.identity, self.ranks("export_base"), self.echo)
            self.ranks("load_base", main_only=base)  # computes on it, as workers do (int8g64: dequantized)
            adapter = base.spec
        contract = build_contract(cfg, model_dir, self.task, self.codec, self.policy.vocab_size,
                                  self.tools.retriever, task_data=data, adapter=adapter)
        contract = signer.sign_contract(contract) if signer is not None else contract
        self.contract = ensure_contract(self.bucket, contract, model_dir, task_files=data.files, config=cfg)
        self.publisher = WeightPublisher(self.bucket, cfg.run, self.contract.weight_plane,
                                         anchor_every=cfg.anchor_every, signer=signer)
        self.quarantine = Quarantine(enabled=cfg.quarantine, disagreement=cfg.quarantine_disagreement,
                                     reject_rate=cfg.quarantine_reject_rate, min_records=cfg.quarantine_min_records,
                                     temperature=cfg.temperature, top_p=cfg.top_p, by_name=keys_on,
                                     drift=cfg.quarantine_drift if cfg.quarantine_sequential else None,
                                     evidence=cfg.quarantine_evidence,
                                     drift_floor=cfg.quarantine_drift_floor or None, max_lag=cfg.staleness_bound,
                                     drift_factor=cfg.quarantine_drift_factor)
        identities = IdentityBook(self.bucket, cfg.run, run_key) if keys_on else None
        self.pool = RecordPool(self.bucket, self.contract, self.task, self.codec, staleness_bound=cfg.staleness_bound,
                               reuse_cap=cfg.reuse_cap, gate=self.quarantine, tools=self.tools.tools,
                               replay=cfg.replay, identities=identities)
        log_dir = default_log_dir(cfg.bucket, cfg.run, cfg.log_dir)
        trackers = open_trackers(cfg.report_to, run_id=cfg.run, source="trainer", bucket=self.bucket,
                                 log_dir=log_dir, config=cfg)
        self.metrics = MetricsWriter(log_dir / "trainer.jsonl", cfg.run, trackers=trackers)
        self.provenance = ProvenanceWriter(self.bucket, cfg.run, self.echo)
        self.summary: dict[str, Any] = {"run": cfg.run, "evals": [], "step_times": [], "checkpoint_path_s": []}
        acfg = self.algo.cfg  # GiGPO's step advantages and ECHO's echo term train on groups of equal rewards
        self.skip_uniform = cfg.skip_uniform_groups and acfg.name != "gigpo" and not acfg.echo_alpha
        self.version = self.step = 0
        self.evaluated_at = -1  # the step of the last held-out eval (the "after" eval skips a step that had one)
        self.cadence = CheckpointCadence(cfg.checkpoint_every, cfg.checkpoint_minutes)
        self.clock = StepClock(cfg.steps, 0)  # restarted from the resumed step when the loop starts
        self.publishing: Background[Any] | None = None
        self.unpublished_rows: list[tuple[dict[str, Any], int]] = []
        self.last_publish: Done[Any] | None = None
        self.lag0_trusted = True  # see resume(): whether lag-0 records can be judged against our weights

    def publish(self, version: int) -> Any:
        """Publish ``version`` now (its pointer written when this returns)."""
        self.start_publish(version)
        return self.settle_publish()

    def start_publish(self, version: int) -> None:
        """Convert the weights to the plane now (every rank: a sharded model is gathered), then encode, upload and
        write the pointer on a thread; ``settle_publish`` waits for it."""

        cfg = self.cfg
        self.fence()
        # A copy: the next step may move the weights. A LoRA run publishes its adapter only (stoa.weights.adapter).
        state = (adapter_state(self.ranks("export_adapter")) if self.contract.adapter
                 else state_from_f32(self.ranks("export"), cfg.plane))

        def upload() -> Any:
            pub = ride_out(lambda: self.publisher.publish(version, state), f"v{version}", self.echo)
            ride_out(lambda: self.publisher.gc(cfg.keep_versions), "(collecting) old weights", self.echo)
            return pub

        self.publishing = Background(upload, f"stoa-publish-v{version}")

    def settle_publish(self) -> Any:
        """Wait for the version being uploaded (if any); its ``PublishResult``, also kept in ``last_publish``."""
        job, self.publishing = self.publishing, None
        self.last_publish = job.join() if job is not None else None
        for row, step in self.unpublished_rows:  # a step's row goes out once its version's pointer is in
            self.metrics.log(row, step=step)
        self.unpublished_rows = []
        self.provenance.flush()  # after the pointer too; a failure is counted, never raised
        return self.last_publish.value if self.last_publish is not None else None

    def fence(self) -> None:
        """Renew the lease by CAS right before a group of writes; ``LeaseLost`` if another trainer took over."""
        ride_out(self.lease.renew, "the lease", self.echo)

    def resume(self) -> None:
        """Continue after the newest published version: weights, optimizer, reuse counts, quarantine."""
        cfg = self.cfg
        pointer = ride_out(self.publisher.resume, "(reading) the published weights", self.echo)
        restored = self.ranks("load")
        journal = ride_out(lambda: ckpt.read_journal(self.bucket, cfg.run), "(reading) the journal", self.echo) or {}
        self.pool.restore(journal.get("pool", {}))
        self.quarantine.restore(journal.get("quarantine", {}))
        self.step = int(journal.get("step", restored.step if restored else 0))
        if pointer is None:
            self.version = 1
            # Evaluate before publishing v1, so workers (which wait for v1) don't compete for the CPU.
            self.evaluate("before")
            if coldstart.run_stage(self):  # supervised steps first: v1 holds the cold-started weights
                self.evaluate("cold start")
            self.publish(1)
            coldstart.finish_stage(self)
            plane = f"an adapter on the {cfg.plane} base" if self.contract.adapter else f"plane {cfg.plane}"
            self.echo(f"[trainer] run {cfg.run}: published v1 ({self.contract.model.architecture}, {plane})")
            return
        self.version = pointer.version
        bad = self.publisher.resume_error
        # Lag-0 records were sampled from the published weights: judge workers by them only once this
        # trainer's weights are those (after its own first publish, or when they verifiably are).
        # A checkpoint ahead of the pointer (killed while its version uploaded) holds weights no worker has.
        ahead = restored is not None and restored.version > pointer.version
        same = restored is not None and restored.version == pointer.version
        self.lag0_trusted = (bad is None and not ahead) or same
        if bad is not None:
            self.echo(f"[trainer] the published v{pointer.version} does not verify ({bad}); the next version is "
                      "published as a fresh anchor so workers recover")
        behind = restored is not None and restored.version < pointer.version
        if bad is None and (restored is None or behind):  # no checkpoint, or killed between publish and it

            assert self.publisher.published_state is not None
            self.ranks("load_full", main_only=state_to_f32(self.publisher.published_state, self.publisher.plane))
            if restored is not None and cfg.lora_rank:  # kept its checkpoint's adapter: not the published weights
                self.lag0_trusted = False
            elif restored is not None:
                self.echo(f"[trainer] checkpoint v{restored.version} is behind the published v{pointer.version}: "
                          "continuing from the published weights (optimizer state from the checkpoint)")
        elif restored is None:
            self.load_newest_verified(pointer)
        self.echo(f"[trainer] resumed run {cfg.run} at v{self.version} (checkpoint "
                  f"v{restored.version if restored else '-'}, step {self.step})")

    def load_newest_verified(self, pointer: Any) -> None:
        """No checkpoint and unverifiable published weights: continue from the newest state that verifies."""

        cfg = self.cfg
        sync = WeightSync(self.bucket, cfg.run, self.publisher.plane, run_key=self.publisher.run_key)
        try:
            at, state = ride_out(lambda: sync.newest_verified(pointer), "(reading) older verified weights", self.echo)
        except SyncError as e:
            raise SystemExit(f"stoa: run {cfg.run!r} has no trainer checkpoint and no published weights verify "
                             f"({e}); restore {checkpoint_key(cfg.run)} or start a new run") from None
        self.ranks("load_full", main_only=state_to_f32(state, self.publisher.plane))
        self.echo(f"[trainer] no checkpoint: continuing from the newest verified weights, v{at}")

    def run(self) -> dict[str, Any]:
        """Resume, then step until the run's total steps or a stop. The run's status says ``running`` from the
        first loop on, ``finished`` when the steps are reached or the trainer stops cleanly (written before the
        last eval, so workers stop competing for the machine) and ``failed`` on an exception."""
        self.open_lifecycle()
        try:
            self.resume()
            steps_here = self.loop()
            self.settle_publish()  # the last version's pointer before the run reads finished
            if self.cadence.final_due(self.step, steps_here):  # finished, or stopped by SIGINT/SIGTERM
                self.checkpoint()
            self.settle_checkpoint()  # the last checkpoint's pointer before the run reads finished
            self.ranks.stop()  # raises if a rank died: the run then reads failed, not finished
        except BaseException as e:
            self.close_lifecycle("failed", e)
            raise
        self.close_lifecycle("finished")
        if self.final_eval_due(steps_here):
            self.evaluate("after")
        self.metrics.log(self.cost.row(self.pool.reports, 0.0, step=False))  # the requests after the last step
        self.metrics.close()
        self.echo("[trainer] bucket requests of this trainer: " + ", ".join(
            f"{n} {name}" for name, n in sorted(METER.by_request().items())))
        rates = self.run_status.rates  # workers' reported speeds not trusted (docs/fleet.md, "Pacing")
        self.summary.update(version=self.version, step=self.step, deleted_objects=self.deleted_objects,
                            status_writes=self.run_status.writes, rates_rejected=rates.rejected,
                            rates_capped=rates.capped, excess_groups=rates.excess)
        return self.summary

    def open_lifecycle(self) -> None:
        """The run's status writer, rollout retention (from where the previous trainer left it) and the
        metrics chunks in the bucket, each fenced by the lease."""
        cfg = self.cfg
        fence = getattr(self, "fence", None)
        self.run_status = StatusPublisher(self.bucket, cfg.run, cfg.status_seconds, fence=fence, target_steps=cfg.steps,
                                          groups_per_step=cfg.groups_per_step)
        self.skips = UniformSkips(cfg.groups_per_step * (cfg.staleness_bound + 1))
        prior = self.run_status.prior
        self.retention = RolloutRetention(self.bucket, cfg.run, cfg.staleness_bound, cfg.keep_rollout_versions,
                                          prior.rollouts_kept_from if prior is not None else 1)
        self.metrics.sink = BucketMetrics(self.bucket, cfg.run, "trainer", flush_rows=cfg.metrics_flush_rows,
                                          flush_seconds=cfg.metrics_flush_seconds, fence=fence)
        self.last_step_s, self.deleted_objects = 0.0, 0
        self.cost = CostClock(METER, Prices.from_env())

    def beat(self) -> None:
        """Write the run's status when the version moved or the heartbeat is due, with the groups still
        wanted from the current window (after the pool listing, so the count is fresh)."""
        cfg, skipped = self.cfg, self.pool.stats.skipped_uniform
        wanted = (wanted_groups(cfg.groups_per_step, cfg.staleness_bound, self.pool.available(),
                                self.skips.counted(skipped, self.step)) if cfg.backpressure else None)
        if (note := self.skips.note(skipped, self.pool.available(), self.version)) is not None:
            self.echo(note)
        self.run_status.beat(self.version, wanted, step_s=self.last_step_s, kept_from=self.retention.kept_from,
                             step=self.step, seen=self.pool.entries.values())

    def close_lifecycle(self, state: str, error: BaseException | None = None) -> None:
        """Write the final status (``stoa.trainer.closing.close_lifecycle``)."""
        closing.close_lifecycle(self, state, error)

    def loop(self) -> int:
        """Refresh the pool, beat, wait or step, until the run's total steps or a stop; return steps taken."""
        cfg = self.cfg
        steps_here, waited_since, last_note, empty = 0, time.monotonic(), 0.0, 0
        self.last_step_at, self.clock = time.monotonic(), StepClock(cfg.steps, self.step)
        while not self.stop.requested and (cfg.steps == 0 or self.step < cfg.steps):  # steps: run total
            empty = 0 if self.pool.refresh(self.version) else empty + 1
            self.beat()
            if self.pool.available() < cfg.groups_per_step:
                idle = time.monotonic() - waited_since
                if cfg.max_wait_seconds and idle > cfg.max_wait_seconds:
                    raise TimeoutError(f"no usable records for {idle:.0f}s (have {self.pool.available()} groups, "
                                       f"need {cfg.groups_per_step}); are workers running for run {cfg.run!r}?")
                if idle - last_note > 30:
                    skipped = self.pool.stats.skipped_uniform
                    why = (f"; {skipped} skipped since the last step, all their rewards equal "
                           "(--no-skip-uniform-groups trains on them)" if skipped else "")
                    self.echo(f"[trainer] v{self.version}: waiting for records "
                              f"({self.pool.available()}/{cfg.groups_per_step} groups{why})")
                    last_note = idle
                if self.publishing is not None and self.publishing.done():
                    self.settle_publish()  # the step's metrics row goes out now, not at the next step
                self.ranks.keepalive()
                time.sleep(poll_delay(cfg.poll_seconds, empty))
                continue
            entries = self.pool.take(cfg.groups_per_step, keep=lambda r: bool(self.algo.keep_groups(r[None, :])[0]),
                                     skip_uniform=self.skip_uniform)
            if not entries:
                continue
            self.train(entries)
            steps_here += 1
            if self.periodic_eval_due():
                self.evaluate(f"step {self.step}")
            waited_since = time.monotonic()
        return steps_here

    def train(self, entries: list[Entry]) -> None:
        """One step: train (the next step's intake and the last version's upload run meanwhile), journal the uses,
        publish the new version (its upload in the background), checkpoint, log."""
        cfg = self.cfg
        journal = {"version": self.version + 1, "step": self.step + 1, "pool": self.pool.state(),
                   "quarantine": self.quarantine.state()}  # this step's uses, before the intake below moves on
        intake = Background(lambda: self.pool.refresh(self.version), "stoa-intake")
        try:
            m = self.ranks("step", entries, self.version, self.step, self.quarantine.wants_rounding(self.step))
        finally:
            intake.join()
        self.settle_publish()  # the last version's pointer is in before this step's journal
        self.fence()
        ride_out(lambda: ckpt.write_journal(self.bucket, cfg.run, journal), "the journal", self.echo)
        if self.lag0_trusted:
            self.quarantine.observe_step(m.disagreement, m.rounding)
        self.lag0_trusted = True  # from now on lag 0 means "sampled from weights this trainer published"
        self.version, self.step = self.version + 1, self.step + 1
        self.start_publish(self.version)
        if self.cadence.due(self.step):
            self.checkpoint()
        deleted = self.retention.collect(self.version)
        self.deleted_objects += deleted
        self.last_step_s = m["step_time_s"]
        self.log_step(entries, m, deleted)
        if self.metrics.completions_due(self.step):
            self.metrics.log_completions(sample_completions(entries, self.codec.decode), self.step)

    def checkpoint(self) -> None:
        """Checkpoint this step's weights and optimizer state (every rank; older checkpoints dropped after): wait
        for the last write, take the state and write it, in the background at world size 1
        (``stoa.trainer.ckpt_async``). Its pointer waits for the weights pointer of the version it claims."""
        t0 = time.perf_counter()
        self.fence()
        job = self.publishing  # this version's upload, when it is still running
        self.ranks("save", self.version, self.step, main_only=(lambda: job.join()) if job is not None else None)
        self.cadence.saved(self.step)
        self.summary["checkpoint_path_s"].append(time.perf_counter() - t0)

    def settle_checkpoint(self, failing: bool = False) -> None:
        """Wait for the checkpoint write in flight (rank 0's; a sharded trainer writes synchronously); when the
        run is ``failing`` (or closing), a failed write is one line instead of an exception."""
        try:
            self.ops.settle_save()
        except Exception as e:
            if not failing:
                raise
            self.echo(f"[trainer] the last checkpoint write failed too ({type(e).__name__}: {e})")

    def log_step(self, entries: list[Entry], m: dict[str, float], deleted: int) -> None:
        since, self.last_step_at = time.monotonic() - self.last_step_at, time.monotonic()
        pub = self.last_publish
        row = step_row(entries, m, self.pool.drain_stats(), version=self.version, since_s=since,
                       staleness_bound=self.cfg.staleness_bound, deleted=deleted,
                       publish=pub.value if pub else None, publish_s=pub.seconds if pub else 0.0)
        row.update(self.quarantine.metrics())
        row.update(self.cost.row(self.pool.reports, float(m.get("tokens", 0.0))))
        self.provenance.add(self.step, step_provenance(entries, getattr(m, "groups", {}), step=self.step,
                                                       version=self.version - 1, replay=self.pool.replay,
                                                       worker_of=entry_worker))
        row["train/provenance_unwritten"] = self.provenance.failed
        self.unpublished_rows.append((row, self.step))  # logged by settle_publish: never a version not published
        self.summary["step_times"].append(m["step_time_s"])
        self.echo(step_line(row, self.clock.tick(self.step)))

    def evaluator_running(self) -> bool:
        """Whether a follow-along evaluator (``stoa eval --follow``) beats on this run: the periodic evals are
        then its job (the trainer keeps its before/after evals)."""

        try:
            return evaluator_present(self.bucket, self.cfg.run, EVALUATOR_MAX_AGE_S)
        except BucketError:
            return False

    def periodic_eval_due(self) -> bool:
        """Whether this step gets an ``eval_every`` eval: not the run's last step, whose eval is the "after" one
        (it samples ``eval_k_final`` episodes per prompt), and not while a follow-along evaluator runs."""
        cfg = self.cfg
        every = cfg.eval_every and self.step % cfg.eval_every == 0
        return bool(every) and self.step != cfg.steps and not self.evaluator_running()

    def final_eval_due(self, steps_here: int) -> bool:
        """Whether the run ends with the "after" eval: it took a step here, that step had no eval (a run stopped
        early at an ``eval_every`` step has its figures already), and no follow-along evaluator covers it (it
        evaluates every version on the ``eval_every`` cadence)."""
        if steps_here == 0 or self.evaluated_at == self.step:
            return False
        every = self.cfg.eval_every
        return not (every and self.step % every == 0 and self.evaluator_running())

    def evaluate(self, label: str) -> None:
        """One held-out eval (``stoa.trainer.closing.run_eval``)."""
        closing.run_eval(self, label)
        self.evaluated_at = self.step
