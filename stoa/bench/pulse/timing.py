"""Publish and sync timing of the PULSE benchmark: one version through the bucket, and workers catching up.

Every figure comes with a check that the path reproduced the trainer's stored bits (``bit_identical``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from stoa.bucket import Bucket
from stoa.layout import patch_key
from stoa.weights.hashing import state_hash
from stoa.weights.patch_format import PatchInfo
from stoa.weights.planes import State
from stoa.weights.publish import PublishInfo, WeightPublisher
from stoa.weights.pulse import apply_patch, encode_patch, read_patch_header
from stoa.weights.sync import WeightSync

from .stats import states_identical, timed, timed_cpu


@dataclass(frozen=True)
class Runs:
    """Where one learning rate publishes: a patch run and a full-anchor run of the same versions.

    Args:
        bucket: the local bucket both runs live in.
        run_id: the patch run (anchor at v1, then one PULSE patch per version).
        full_run: the run that publishes every version as a full anchor (the full-sync baseline).
        plane: the weight plane.
        repeat: timed repeats per measurement (the median is taken).
    """

    bucket: Bucket
    run_id: str
    full_run: str
    plane: str
    repeat: int


class Held(NamedTuple):
    """The weights a worker holds: version, stored state and state hash."""

    version: int | None
    state: State | None
    state_hash: str | None


@dataclass(frozen=True)
class VersionTiming:
    """What publishing one version cost, what syncing it took, whether each path got the trainer's bits."""

    pub: PublishInfo
    """The patch run's publish (patch bytes, seconds, state hash)."""
    full_pub: PublishInfo
    """The full run's publish of the same state as an anchor."""
    info: PatchInfo
    """The published patch's header."""
    encode_s: float
    encode_cpu_s: float
    apply_s: float
    apply_cpu_s: float
    sync_s: float
    """A worker one version behind syncing through the bucket (median)."""
    full_sync_s: float
    """A fresh worker syncing the full run's anchor (median)."""
    held: Held
    """The one-behind worker after its sync."""
    identical: bool


class CatchUp(NamedTuple):
    """A worker catching up to the newest version: median seconds, bytes read, and whether it got the bits."""

    seconds: float
    bytes: int
    ok: bool


def worker_at(runs: Runs, run_id: str, held: Held) -> WeightSync:
    """A worker of ``run_id`` that already holds ``held``.

    Args:
        runs: bucket and plane.
        run_id: the run to follow.
        held: the weights it starts from.
    """
    w = WeightSync(runs.bucket, run_id, runs.plane)
    w.version, w.state, w.state_hash = held.version, held.state, held.state_hash
    return w


def first_sync(runs: Runs, state: State, published_hash: str) -> tuple[Held, bool]:
    """A worker joins the patch run at v1; return what it holds and whether it holds the trainer's bits.

    Args:
        runs: the runs of this lr.
        state: the trainer's stored state at v1.
        published_hash: the state hash v1 was published with.
    """
    worker = WeightSync(runs.bucket, runs.run_id, runs.plane)
    version, synced = worker.sync()
    held = Held(version, synced, worker.state_hash)
    return held, states_identical(synced, state) and held.state_hash == published_hash


def time_version(runs: Runs, publisher: WeightPublisher, version: int, prev: State, state: State,
                 held: Held) -> VersionTiming:
    """Publish ``state`` as ``version`` and time encode, apply, a one-behind sync and a full sync of it.

    Args:
        runs: the runs of this lr.
        publisher: the patch run's publisher (at ``version - 1``).
        version: the version to publish.
        prev: the stored state at ``version - 1``.
        state: the stored state at ``version``.
        held: the worker one version behind.
    """
    trainer_hash = state_hash(state)
    pub = publisher.publish(version, state)
    patch = runs.bucket.get(patch_key(runs.run_id, version))
    info = read_patch_header(patch)
    encode_s, encode_cpu_s, again = timed_cpu(
        lambda: encode_patch(prev, state, run_id=runs.run_id, from_version=version - 1, to_version=version,
                             plane=runs.plane), runs.repeat)
    apply_s, apply_cpu_s, (applied, _) = timed_cpu(
        lambda: apply_patch(prev, patch, run_id=runs.run_id, expected_from_version=version - 1,
                            plane=runs.plane), runs.repeat)
    sync_s, synced, new_hash, path = _sync_one_behind(runs, held)
    full_pub, full_sync_s, full_state = _full_sync(runs, version, state)
    pointer = publisher.pointer
    identical = (
        pub.state_hash == trainer_hash
        and pointer is not None
        and pointer.state_hash == trainer_hash
        and info.state_hash == trainer_hash
        and new_hash == trainer_hash
        and path == "patches"
        and again == patch
        and states_identical(synced, state)
        and states_identical(applied, state)
        and states_identical(full_state, state)
        and full_pub.state_hash == trainer_hash
    )
    return VersionTiming(pub, full_pub, info, encode_s, encode_cpu_s, apply_s, apply_cpu_s, sync_s,
                         full_sync_s, Held(version, synced, new_hash), identical)


def _sync_one_behind(runs: Runs, held: Held) -> tuple[float, State, str | None, str]:
    """A worker at the previous version syncs through the bucket (pointer, listing, patch, verify).

    Returns the median seconds, the state and state hash it ends with, and the sync path it took.
    """
    times: list[float] = []
    synced: State = {}
    new_hash: str | None = None
    path = ""
    for _ in range(max(1, runs.repeat)):
        w = worker_at(runs, runs.run_id, held)
        t = time.perf_counter()
        _, synced = w.sync()
        times.append(time.perf_counter() - t)
        new_hash, path = w.state_hash, w.metrics["path"]
    return statistics.median(times), synced, new_hash, path


def _full_sync(runs: Runs, version: int, state: State) -> tuple[PublishInfo, float, State]:
    """Full-weight sync of the same version: an anchor in the full run, read by a fresh worker.

    Returns the anchor's publish, the median sync seconds and the state the worker read.
    """
    full_pub = WeightPublisher(runs.bucket, runs.full_run, runs.plane).publish(version, state)
    WeightPublisher(runs.bucket, runs.full_run, runs.plane).gc(0)
    full_sync_s, (_, full_state) = timed(lambda: WeightSync(runs.bucket, runs.full_run, runs.plane).sync(),
                                         runs.repeat)
    return full_pub, full_sync_s, full_state


def catch_up(make: Callable[[], WeightSync], expect: str, target_hash: str, final: State,
             repeat: int) -> CatchUp:
    """Time workers from ``make`` syncing to the newest version; check the path and the bits they end with.

    Args:
        make: builds a worker in its starting position.
        expect: the sync path it must take (``patches`` or ``anchor``).
        target_hash: the pointer's state hash.
        final: the trainer's stored state at the newest version.
        repeat: timed repeats (median).
    """
    times, nbytes, ok = [], 0, True
    for _ in range(max(1, repeat)):
        w = make()
        t = time.perf_counter()
        _, st = w.sync()
        times.append(time.perf_counter() - t)
        nbytes = int(w.metrics["bytes"])
        ok = (ok and w.metrics["path"] == expect and w.state_hash == target_hash
              and states_identical(st, final))
    return CatchUp(statistics.median(times), nbytes, ok)


def catch_ups(runs: Runs, lagging: Held, final: State, target_hash: str) -> dict[str, CatchUp]:
    """Catch-up three ways: a worker behind by patches, a late joiner (anchor v1 + every patch), a full sync.

    Args:
        runs: the runs of this lr.
        lagging: the worker that stayed behind.
        final: the trainer's stored state at the newest version.
        target_hash: the pointer's state hash.
    """
    def fresh(run_id: str) -> Callable[[], WeightSync]:
        return lambda: WeightSync(runs.bucket, run_id, runs.plane)

    return {
        "patches": catch_up(lambda: worker_at(runs, runs.run_id, lagging), "patches", target_hash, final,
                            runs.repeat),
        "anchor": catch_up(fresh(runs.run_id), "anchor", target_hash, final, runs.repeat),
        "full": catch_up(fresh(runs.full_run), "anchor", target_hash, final, runs.repeat),
    }
