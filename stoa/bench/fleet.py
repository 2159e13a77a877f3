"""Fleet intake benchmark: the trainer's real intake (``RecordPool.refresh`` + ``take``) against many simulated
workers uploading valid records to a local bucket or to an S3 endpoint on 127.0.0.1 (moto).

Time is simulated: a step advances the clock by ``--step-seconds`` (plus the intake's own measured seconds and
the trainer loop's wait between polls: ``poll_delay``), and every active worker lands ``--groups-per-min`` records
a minute on its own schedule, each at the trainer's version minus a lag (most at lag 0, fewer at each older
version of the window). Per step it counts LIST pages (1,000 keys each, R2 Class A) and GETs (Class B) and
times listing, reading and checking (decode, validation, prompt re-rendering, rewards) separately.
``--mix`` runs the mixed-fleet pacing benchmark instead (``stoa.bench.fleetmix``), ``--churn`` the throughput
under churn one (``stoa.bench.churn``: real processes).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from stoa.bench import churn, fleetmix
from stoa.bench.records import RecordMaker, Run, make_run
from stoa.bucket import Bucket, ObjectInfo, open_bucket
from stoa.observe.snapshot import LIST_PAGE
from stoa.trainer.demand import poll_delay
from stoa.trainer.pool import RecordPool

__all__ = ["RecordMaker", "Run", "make_run"]  # re-exported: they lived here

S3_BUCKET = "stoa-bench"
_MOTO_ENV = {"AWS_ACCESS_KEY_ID": "moto-key", "AWS_SECRET_ACCESS_KEY": "moto-fake-secret-bench",
             "AWS_REGION": "us-east-1"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``stoa bench fleet``.

    Args:
        p: the subcommand's parser.
    """
    p.add_argument("--workers", default="10,100,1000", help="comma list of active worker counts [default: 10,100,1000]")
    p.add_argument("--idle-workers", type=int, default=0, help="workers that upload nothing, added to each count")
    p.add_argument("--windows", default="3", help="comma list of staleness bounds [default: 3]")
    p.add_argument("--backend", default="local", help="comma list of local,s3 (s3: moto on 127.0.0.1) [default: local]")
    p.add_argument("--s3", action="store_true", help="add the s3 backend (same as --backend local,s3)")
    p.add_argument("--groups-per-min", type=float, default=1.0, help="records per active worker a minute [default: 1]")
    p.add_argument("--step-seconds", type=float, default=30.0, help="simulated training time of a step [default: 30]")
    p.add_argument("--steps", type=int, default=3, help="measured steps, after the window fills [default: 3]")
    p.add_argument("--groups-per-step", type=int, default=8, help="groups the trainer takes a step [default: 8]")
    p.add_argument("--reuse-cap", type=int, default=2, help="the pool's reuse cap [default: 2]")
    p.add_argument("--poll-seconds", type=float, default=0.5, help="simulated wait between polls [default: 0.5]")
    p.add_argument("--no-backoff", action="store_true",
                   help="wait --poll-seconds after every empty poll (the trainer backs off: poll_delay)")
    p.add_argument("--lag-decay", type=float, default=0.5,
                   help="P(lag k+1) / P(lag k) of a record's version lag inside the window [default: 0.5]")
    p.add_argument("--rtt-ms", type=float, default=0.0,
                   help="added round trip per LIST page and GET, to model a remote store [default: 0]")
    p.add_argument("--task", default="toy", help="single-turn task of the records [default: toy]")
    p.add_argument("--seed", type=int, default=0, help="random seed [default: 0]")
    p.add_argument("--out", default="", help="append one JSONL row per scenario to this file")
    fleetmix.add_arguments(p)
    churn.add_arguments(p)


@dataclass(frozen=True)
class Scenario:
    """One measured configuration: backend, active and idle workers, staleness bound."""

    backend: str
    workers: int
    idle: int
    window: int


@dataclass
class StepFigures:
    """What one simulated step cost the trainer's intake."""

    new_records: int = 0
    polls: int = 0
    lists: int = 0
    gets: int = 0
    list_s: float = 0.0
    get_s: float = 0.0
    check_s: float = 0.0
    take_s: float = 0.0
    wall_s: float = 0.0

    @property
    def intake_s(self) -> float:
        """Seconds of intake in the step (listing, reading, checking, taking)."""
        return self.list_s + self.get_s + self.check_s + self.take_s


class MeteredBucket:
    """The pool's view of a bucket: counts LIST pages (``LIST_PAGE`` keys each, at least one per listing) and
    GETs, keeps each request's time span (the pool sends them concurrently), and adds ``rtt_s`` per request.

    Args:
        inner: the bucket.
        rtt_s: seconds added per LIST page and GET.
    """

    def __init__(self, inner: Bucket, rtt_s: float = 0.0) -> None:
        self.inner, self.url, self.rtt_s = inner, inner.url, rtt_s
        self.lists = self.gets = 0
        self.spans: dict[str, list[tuple[float, float]]] = {"list": [], "get": []}
        self.lock = threading.Lock()

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` after ``start_after`` (read whole, counted, timed)."""
        t0 = time.perf_counter()
        items = list(self.inner.list(prefix, start_after=start_after))
        pages = max(1, math.ceil(len(items) / LIST_PAGE))
        if self.rtt_s:
            time.sleep(self.rtt_s * pages)
        with self.lock:
            self.lists += pages
            self.spans["list"].append((t0, time.perf_counter()))
        return iter(items)

    def get(self, key: str) -> bytes:
        """The object's bytes (counted, timed)."""
        t0 = time.perf_counter()
        if self.rtt_s:
            time.sleep(self.rtt_s)
        try:
            return self.inner.get(key)
        finally:
            with self.lock:
                self.gets += 1
                self.spans["get"].append((t0, time.perf_counter()))

    def busy_s(self, kind: str, since: float) -> float:
        """Seconds since ``since`` during which at least one request of ``kind`` (list, get) was in flight.

        Args:
            kind: ``list`` or ``get``.
            since: a ``time.perf_counter()`` value.
        """
        total, end = 0.0, since
        for a, b in sorted(s for s in self.spans[kind] if s[1] > since):
            a = max(a, end)
            if b > a:
                total, end = total + b - a, b
        return total


class Fleet:
    """Simulated workers: each active one lands a valid record every ``60 / groups_per_min`` simulated seconds,
    from a random phase; idle ones land nothing.

    Args:
        bucket: where records land (not metered: uploads are the workers' cost).
        maker: builds a record's bytes.
        workers: active workers.
        idle: idle workers (never due).
        groups_per_min: records per active worker a minute.
        lag_decay: P(lag k+1) / P(lag k).
        seed: random seed.
    """

    def __init__(self, bucket: Bucket, maker: RecordMaker, workers: int, idle: int, groups_per_min: float,
                 lag_decay: float, seed: int) -> None:
        self.bucket, self.maker, self.lag_decay = bucket, maker, lag_decay
        self.rng = np.random.default_rng(seed)
        self.period = 60.0 / groups_per_min
        self.next_at = np.concatenate([self.rng.uniform(0.0, self.period, size=workers), np.full(idle, np.inf)])
        self.seqs = np.zeros(workers + idle, dtype=np.int64)
        self.uid = 0  # a fleet-wide record counter: every record's content differs

    def land(self, now: float, version: int, window: int) -> int:
        """Upload every record due by ``now`` (sampled at ``version`` minus a lag inside the window).

        Args:
            now: simulated seconds.
            version: the trainer's current version.
            window: the staleness bound.

        Returns:
            How many records landed.
        """
        lags = self.lag_decay ** np.arange(min(window, version - 1) + 1)
        jobs = []
        for w in np.flatnonzero(self.next_at <= now):
            while self.next_at[w] <= now:
                lag = int(self.rng.choice(lags.size, p=lags / lags.sum()))
                jobs.append((int(w), int(self.seqs[w]), version - lag, self.uid))
                self.seqs[w] += 1
                self.uid += 1
                self.next_at[w] += self.period
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(lambda job: self.maker.put(self.bucket, *job), jobs))
        return len(jobs)


def run_scenario(sc: Scenario, bucket: Bucket, run: Run, args: argparse.Namespace) -> list[StepFigures]:
    """Drive the trainer's intake through ``window + 1`` warm-up steps (the window fills) and ``args.steps``
    measured ones; return the measured steps.

    Args:
        sc: the scenario.
        bucket: an empty bucket.
        run: the run's contract, task and codec.
        args: the bench's flags.
    """

    metered = MeteredBucket(bucket, args.rtt_ms / 1000)
    pool = RecordPool(cast(Bucket, metered), run.contract, run.task, run.codec, staleness_bound=sc.window,
                      reuse_cap=args.reuse_cap)
    fleet = Fleet(bucket, RecordMaker(run.contract, run.task, run.codec), sc.workers, sc.idle,
                  args.groups_per_min, args.lag_decay, args.seed)
    steps: list[StepFigures] = []
    now, warm = 0.0, sc.window + 1
    while len(steps) < warm + args.steps:
        steps.append(_step(pool, metered, fleet, now, len(steps) + 1, sc.window, args))
        now += steps[-1].wall_s
    rejected = pool.drain_stats().rejected
    if rejected:
        raise RuntimeError(f"the pool rejected synthetic records {dict(rejected)}: fix RecordMaker")
    return steps[warm:]


def _step(pool: Any, metered: MeteredBucket, fleet: Fleet, start: float, version: int, window: int,
          args: argparse.Namespace) -> StepFigures:
    """One trainer-loop step: refresh (and wait between polls as the trainer does) until a batch is there, take
    it, train for ``step_seconds``; the clock also advances by the intake's measured seconds."""

    f, now, empty = StepFigures(), start, 0
    while True:
        f.new_records += fleet.land(now, version, window)
        lists, gets = metered.lists, metered.gets
        t0 = time.perf_counter()
        empty = 0 if pool.refresh(version) or args.no_backoff else empty + 1
        dt = time.perf_counter() - t0
        list_s, get_s = metered.busy_s("list", t0), metered.busy_s("get", t0)
        f.polls += 1
        f.lists, f.gets = f.lists + metered.lists - lists, f.gets + metered.gets - gets
        f.list_s, f.get_s, f.check_s = f.list_s + list_s, f.get_s + get_s, f.check_s + max(0.0, dt - list_s - get_s)
        now += dt
        if pool.available() >= args.groups_per_step:
            break
        if now - start > 3600:
            raise RuntimeError(f"v{version}: under {args.groups_per_step} groups after an hour of simulated "
                               "waiting; add workers or lower --groups-per-step")
        now += poll_delay(args.poll_seconds, empty)
    t0 = time.perf_counter()
    pool.take(args.groups_per_step)
    f.take_s = time.perf_counter() - t0
    f.wall_s = now + f.take_s + args.step_seconds - start
    return f


def summarize(sc: Scenario, steps: list[StepFigures], args: argparse.Namespace) -> dict[str, Any]:
    """One table row: the scenario and its per-step means.

    Args:
        sc: the scenario.
        steps: its measured steps.
        args: the bench's flags.
    """
    mean = {k: float(np.mean([getattr(s, k) for s in steps])) for k in asdict(StepFigures())}
    intake = float(np.mean([s.intake_s for s in steps]))
    return {"bench": "fleet", **asdict(sc), "groups_per_min": args.groups_per_min, "step_seconds": args.step_seconds,
            "rtt_ms": args.rtt_ms, "steps": len(steps), **mean, "intake_s": intake,
            "intake_share": intake / mean["wall_s"] if mean["wall_s"] else 0.0}


def _moto() -> tuple[Any, dict[str, str]]:
    """A moto S3 server on 127.0.0.1 with the bench bucket, and the variables that reach it."""
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError:
        raise SystemExit("stoa bench fleet --s3 needs moto[server]: pip install 'moto[server]'") from None
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {**_MOTO_ENV, "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                 aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1").create_bucket(
        Bucket=S3_BUCKET)
    return server, env


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: give a comma list of integers, e.g. 10,100,1000") from None


def print_table(rows: list[dict[str, Any]]) -> None:
    """Print the scenarios' per-step means.

    Args:
        rows: what ``summarize`` returned.
    """
    head = (f"{'backend':7} {'workers':>7} {'idle':>5} {'window':>6} {'new/step':>8} {'polls':>5} {'LIST/step':>9} "
            f"{'GET/step':>8} {'list s':>7} {'get s':>7} {'check s':>7} {'take s':>7} {'intake s':>8} {'share':>6}")
    print("\n" + head)
    for r in rows:
        print(f"{r['backend']:7} {r['workers']:7d} {r['idle']:5d} {r['window']:6d} {r['new_records']:8.1f} "
              f"{r['polls']:5.1f} {r['lists']:9.1f} {r['gets']:8.1f} {r['list_s']:7.3f} {r['get_s']:7.3f} "
              f"{r['check_s']:7.3f} {r['take_s']:7.3f} {r['intake_s']:8.3f} {100 * r['intake_share']:5.2f}%")


def main(args: argparse.Namespace) -> int:
    """Run every scenario (backend x workers x window), print a table, append JSONL rows to ``--out``.

    Args:
        args: parsed flags (see ``add_arguments``).
    """
    if args.mix:
        return fleetmix.main(args)
    if args.churn:
        return churn.main(args)
    backends = list(dict.fromkeys([b.strip() for b in args.backend.split(",") if b.strip()] + ["s3"] * args.s3))
    if not set(backends) <= {"local", "s3"}:
        raise SystemExit(f"--backend {args.backend!r}: give a comma list of local,s3")
    workers, windows = _ints(args.workers, "--workers"), _ints(args.windows, "--windows")
    run = make_run(args.task)
    server, env = _moto() if "s3" in backends else (None, {})
    print(f"intake of {args.groups_per_min:g} group/min per worker, {args.step_seconds:g} s steps, "
          f"{args.groups_per_step} groups/step, task {args.task}, rtt {args.rtt_ms:g} ms; "
          f"{args.steps} measured steps after the window fills")
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="stoa-fleet-") as tmp:
            for backend, w, window in itertools.product(backends, workers, windows):
                sc = Scenario(backend, w, args.idle_workers, window)
                url = (str(Path(tmp) / f"{w}-{window}") if backend == "local"
                       else f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}")
                t0 = time.perf_counter()
                rows.append(summarize(sc, run_scenario(sc, open_bucket(url, env), run, args), args))
                print(f"  {backend} workers {w} window {window}: {time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        if server is not None:
            server.stop()
    print_table(rows)
    if args.out:
        with Path(args.out).open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0
