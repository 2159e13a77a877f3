"""Throughput under churn (``stoa bench fleet --churn``): a real trainer and real worker processes on the tiny model
and a local bucket, with workers joining and leaving on a seeded schedule (``stoa.bench.churnplan``: exponential
times between events, mean ``--churn-mean-s``; a leaving worker gets SIGKILL or SIGTERM) and the trainer killed
with SIGKILL once and restarted at once (it resumes from its checkpoint and published weights); then a steady
fleet of the schedule's average size for the same wall time. Each run's clock starts at the trainer's first step
(every process started: the warm-up is the same for both); events are timed from there. Per run it prints wall
time, steps, useful (distinct trained) groups and their rate per minute, groups sampled and wasted (stale,
surplus, lost in flight), read from the trainer's metrics rows, the records and the workers' metrics files; the
last line is
``ratio_churn_vs_steady=X``: useful groups per minute per average live worker, churned over steady.

The tiny model samples a group in milliseconds, so its workers would outrun the trainer and no departure would
show; each worker therefore sleeps ``--churn-group-seconds`` per group inside its engine (a machine of that speed;
the worker's code is otherwise the real ``stoa worker``). The trainer's reuse cap is 1: every step trains fresh
groups, so the run's rate is the fleet's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import stoa.engines
from stoa.bench.churnplan import (
    Books,
    Mark,
    Schedule,
    join_delays,
    lost_in_flight,
    plan,
    read_landed,
    read_rows,
    restart_gaps,
    steady,
    tally,
)

BOUND = 3
"""The runs' staleness bound."""
TRAINER_ARGS = ("--model", "tiny", "--task", "toy", "--n-samples", "4", "--groups-per-step", "8",
                "--max-new-tokens", "8", "--lr", "1e-5", "--no-skip-uniform-groups", "--eval-n", "0", "--kl-beta", "0",
                "--steps", "0",
                "--staleness-bound", str(BOUND), "--reuse-cap", "1", "--keep-rollout-versions", "-1",
                "--checkpoint-every", "5", "--poll-seconds", "0.2", "--max-wait-seconds", "900")
"""The trainer of both runs (a restart passes only --bucket and --run: the run's stored settings). A small lr and
uniform groups trained: a throughput run must not learn the toy task, or its groups turn uniform and identical (at
lr 1e-3 a 10-minute run's reward reached 0.97 and the trainer skipped or refused most groups as uniform or
duplicate)."""
PACED = "import sys; from stoa.bench.churn import paced_worker; sys.exit(paced_worker(sys.argv[1:]))"
"""``python -c PACED SECONDS worker ...``: ``stoa worker`` whose engine takes SECONDS more per group."""
WARM_S = 300.0
"""Seconds the first trainer step may take (every process starting at once on a small machine)."""
STOP_S = 60.0
"""Seconds the trainer gets to finish its step after SIGTERM at a run's end."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--churn`` flags of ``stoa bench fleet``.

    Args:
        p: the subcommand's parser.
    """
    p.add_argument("--churn", action="store_true",
                   help="run the churn benchmark instead: real trainer and workers, workers joining and leaving")
    p.add_argument("--churn-workers", type=int, default=3, help="--churn: the fleet's average size [default: 3]")
    p.add_argument("--churn-mean-s", type=float, default=20.0,
                   help="--churn: mean seconds between a join or a leave (exponential) [default: 20]")
    p.add_argument("--churn-seconds", type=float, default=150.0,
                   help="--churn: wall seconds of each run, from its first step [default: 150]")
    p.add_argument("--churn-group-seconds", type=float, default=0.5,
                   help="--churn: seconds a worker spends per group on top of the tiny model's [default: 0.5]")
    p.add_argument("--churn-in-flight", type=int, default=4,
                   help="--churn: each worker's groups_in_flight [default: 4]")
    p.add_argument("--churn-restart-at", type=float, default=0.5,
                   help="--churn: when the trainer is killed and restarted, as a share of the run (0: never) "
                        "[default: 0.5]")
    p.add_argument("--churn-dir", default="", help="--churn: keep the runs' buckets and logs here [default: a "
                                                     "temporary directory]")


def paced_worker(argv: list[str]) -> int:
    """``stoa worker`` whose engine sleeps ``argv[0]`` seconds per group after generating (see ``PACED``): the
    engine factory is wrapped before the worker's modules bind it.

    Args:
        argv: the seconds per group, then the ``stoa`` arguments.

    Raises:
        RuntimeError: the worker's modules were imported before the wrap (it would not apply).
    """
    if "stoa.worker.loop" in sys.modules:
        raise RuntimeError("paced_worker: stoa.worker.loop is imported already; call it in a fresh process")
    per_group, real = float(argv[0]), stoa.engines.make_engine

    def make_engine(*a: Any, **kw: Any) -> Any:
        engine = real(*a, **kw)
        generate = engine.generate

        def slow(prompts: Any, *g: Any, **gk: Any) -> Any:
            out = generate(prompts, *g, **gk)
            time.sleep(per_group * len(prompts))
            return out

        setattr(engine, "generate", slow)  # noqa: B010 - an instance attribute over the method
        return engine

    stoa.engines.make_engine = make_engine
    sys.argv = ["stoa", *argv[1:]]
    runpy.run_module("stoa", run_name="__main__")  # python -m stoa (exits): its modules bind the wrapped factory
    return 0


class Fleet:
    """One run's processes: the trainer and the live workers, logs in ``logs``.

    Args:
        root: the local bucket.
        run: the run id.
        args: the bench's flags.
    """

    def __init__(self, root: Path, run: str, args: argparse.Namespace) -> None:
        self.root, self.run, self.args = root, run, args
        self.logs = root / "bench-logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        self.trainer: subprocess.Popen | None = None
        self.trainers = 0
        self.workers: dict[str, subprocess.Popen] = {}
        self.kills: list[Mark] = []
        self.joins: list[Mark] = []
        """Workers started after the first step."""
        self.trainer_kills: list[float] = []
        self.started = False
        """Whether the run's first step was seen (joins from then on are churn)."""

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        with (self.logs / f"{name}.log").open("w") as log:
            return subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT, env=self.env)

    def start_trainer(self) -> None:
        """Start the trainer: with the bench's settings the first time, with the run's stored ones after."""
        first = ("--seed", str(self.args.seed), *TRAINER_ARGS) if self.trainers == 0 else ()
        self.trainer = self._spawn(f"trainer-{self.trainers}", ["-m", "stoa", "trainer", "--bucket", str(self.root),
                                                                "--run", self.run, *first])
        self.trainers += 1

    def restart_trainer(self) -> None:
        """SIGKILL the trainer and start another at once."""
        assert self.trainer is not None
        self.trainer.kill()
        self.trainer_kills.append(time.time())
        self.trainer.wait(timeout=30)
        self.start_trainer()

    def join(self, label: str) -> None:
        """Start worker ``label``."""
        a = self.args
        if self.started:
            self.joins.append(Mark(label, time.time()))
        self.workers[label] = self._spawn(label, [
            "-c", PACED, str(a.churn_group_seconds), "worker", "--bucket", str(self.root), "--run", self.run,
            "--name", label, "--engine", "torch", "--threads", "1", "--groups-in-flight", str(a.churn_in_flight),
            "--poll-seconds", "0.2", "--wait-seconds", "900"])

    def leave(self, label: str, sig: str) -> None:
        """Stop worker ``label`` with SIGKILL or SIGTERM; note the kill."""
        p = self.workers.pop(label)
        p.send_signal(signal.SIGKILL if sig == "KILL" else signal.SIGTERM)
        self.kills.append(Mark(label, time.time()))
        p.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM the trainer (it finishes its step and marks the run finished), then kill every worker."""
        if self.trainer is not None and self.trainer.poll() is None:
            self.trainer.terminate()
            try:
                self.trainer.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                self.trainer.kill()
                self.trainer.wait(timeout=30)
        for p in self.workers.values():
            p.kill()
            p.wait(timeout=30)
        self.workers.clear()

    def resumed(self) -> str:
        """The restarted trainers' ``resumed run ...`` lines (what they resumed from)."""
        lines = []
        for i in range(1, self.trainers):
            m = re.search(r"resumed run \S+ at (v\d+) \(checkpoint (v?[\d-]+), step (\d+)\)",
                          (self.logs / f"trainer-{i}.log").read_text())
            lines.append(f"at {m[1]}, checkpoint {m[2]}, step {m[3]}" if m else "no resume line (see its log)")
        return "; ".join(lines)


def run_fleet(sched: Schedule, root: Path, run: str, args: argparse.Namespace) -> tuple[Books, Fleet]:
    """Run ``sched`` with real processes, stop, and book the run from its files.

    Args:
        sched: the fleet's schedule.
        root: an empty local bucket directory.
        run: the run id.
        args: the bench's flags.
    """
    fleet = Fleet(root, run, args)
    try:
        fleet.start_trainer()
        for label in sched.initial:
            fleet.join(label)
        t0 = first_step(root, run, fleet)
        fleet.started = True
        for e in sched.events:
            time.sleep(max(0.0, t0 + e.t - time.time()))
            if e.kind == "join":
                fleet.join(e.worker)
            elif e.kind == "leave":
                fleet.leave(e.worker, e.signal)
            else:
                fleet.restart_trainer()
            print(f"  {e.t:6.1f}s {e.kind} {e.worker} {e.signal}".rstrip() + f" (live {len(fleet.workers)})",
                  flush=True)
        time.sleep(max(0.0, t0 + sched.duration_s - time.time()))
        t_end = time.time()
    finally:
        fleet.stop()
    rows, worker_rows = read_rows(root, run)
    landed = read_landed(root, run)
    lost = lost_in_flight(fleet.kills, worker_rows, landed, args.churn_in_flight)
    books = tally(rows, landed, t0=t0, t_end=t_end, bound=BOUND, lost=lost, mean_workers=sched.mean_size())
    joins, gaps = join_delays(fleet.joins, landed), restart_gaps(rows, fleet.trainer_kills)
    return replace(books, join_s=sum(joins) / len(joins) if joins else 0.0, restart_s=sum(gaps)), fleet


def first_step(root: Path, run: str, fleet: Fleet, timeout_s: float = WARM_S) -> float:
    """Wait for the trainer's first step (every process started, the fleet warm); return when it was seen.

    Raises:
        RuntimeError: no step within ``timeout_s``, or the trainer exited.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if read_rows(root, run)[0]:
            return time.time()
        if fleet.trainer is not None and fleet.trainer.poll() is not None:
            break
        time.sleep(0.5)
    raise RuntimeError(f"run {run}: no trainer step after {timeout_s:.0f} s; see {fleet.logs}/trainer-0.log "
                       "(--churn-dir keeps it)")


def ratio(churned: Books, steady_books: Books) -> float:
    """Useful groups per minute per average live worker, churned over steady (0 when steady trained nothing).

    Args:
        churned: the churned run's books.
        steady_books: the steady run's books.
    """
    base = steady_books.per_min / steady_books.mean_workers
    return churned.per_min / churned.mean_workers / base if base > 0 else 0.0


def print_table(rows: list[tuple[str, Books]]) -> None:
    """Print one line per run.

    Args:
        rows: (run name, its books).
    """
    print(f"\n{'run':7} {'workers':>7} {'wall s':>6} {'steps':>5} {'trained':>7} {'useful/min':>10} {'sampled':>7} "
          f"{'wasted':>6} {'stale':>5} {'surplus':>7} {'lost~':>5} {'pending':>7} {'refused':>7} {'join s':>6} "
          f"{'restart s':>9}")
    for name, b in rows:
        print(f"{name:7} {b.mean_workers:7.2f} {b.wall_s:6.0f} {b.steps:5d} {b.trained:7d} {b.per_min:10.1f} "
              f"{b.sampled:7d} {b.wasted:6d} {b.stale:5d} {b.surplus:7d} {b.lost:5d} {b.pending:7d} "
              f"{b.refused:7d} {b.join_s:6.1f} {b.restart_s:9.1f}")


def main(args: argparse.Namespace) -> int:
    """Run the churned fleet, then the steady one; print the table and the ratio; append JSONL to ``--out``.

    Args:
        args: parsed flags (``stoa.bench.fleet.add_arguments``).
    """
    restart = args.churn_restart_at * args.churn_seconds if args.churn_restart_at > 0 else None
    sched = plan(args.churn_workers, args.churn_mean_s, args.churn_seconds, args.seed, restart)
    size = max(1, round(sched.mean_size()))
    moves = sum(e.kind != "trainer" for e in sched.events)
    print(f"churn: {len(sched.initial)} workers at the start, {moves} joins and leaves (mean {args.churn_mean_s:g} s "
          f"apart, seed {args.seed}), trainer kill -9 at {restart or 0:.0f} s, average {sched.mean_size():.2f} live; "
          f"steady: {size}; {args.churn_seconds:g} s each, {args.churn_group_seconds:g} s per group per worker")
    out: list[tuple[str, Books]] = []
    with tempfile.TemporaryDirectory(prefix="stoa-churn-") as tmp:
        for name, s in (("churn", sched), ("steady", steady(size, args.churn_seconds))):
            print(f"{name}:", flush=True)
            books, fleet = run_fleet(s, Path(args.churn_dir or tmp) / name, name, args)
            if fleet.trainers > 1:
                print(f"  trainer restarted: {fleet.resumed()}")
            out.append((name, books))
    print_table(out)
    if args.out:
        with Path(args.out).open("a") as f:
            for name, b in out:
                f.write(json.dumps({"bench": "fleet-churn", "run": name, **asdict(b), "per_min": b.per_min}) + "\n")
    print(f"ratio_churn_vs_steady={ratio(out[0][1], out[1][1]):.3f}")
    return 0
