"""Audits of a run after faults or crashes: records, reuse counts, rejections, the weight chain, pointer history.

Everything here reads the bucket and the metrics files only; nothing trusts what a process said
about itself beyond "this record was uploaded" (a worker's metrics row after its put succeeded).
"""

from __future__ import annotations

import collections
import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stoa.bucket import Bucket, BucketError
from stoa.contract import RunContract
from stoa.layout import (
    ANCHOR_FILE,
    ANCHOR_MANIFEST,
    anchor_prefix,
    anchors_prefix,
    contract_key,
    parse_anchor_key,
    parse_patch_key,
    patch_key,
    patches_prefix,
    pointer_key,
    rollout_key,
    rollout_label,
    rollouts_prefix,
)
from stoa.rollouts.records import RecordRejected, RolloutRecord, validate_record
from stoa.telemetry.metrics import read_metrics
from stoa.weights.anchor import check_manifest, decode_anchor
from stoa.weights.errors import WeightsError
from stoa.weights.hashing import state_hash
from stoa.weights.pointer import Pointer
from stoa.weights.pulse import apply_patch
from stoa.weights.sync import WeightSync


def short_key(key: str) -> str:
    """A record key as the trainer's ``rollout/keys`` metric writes it: ``v<version>/<worker>-<seq>.rec``.

    Args:
        key: the full bucket key.
    """
    return rollout_label(key)


_CHUNK_TAIL = re.compile(r"-[0-9]{10}-[0-9]{8}$")
"""The ``-<start>-<seq>`` tail of a bucket metrics chunk's name (``stoa.layout.metrics_chunk_key``)."""


def acknowledged_keys(log_dir: Path, run: str) -> dict[str, list[str]]:
    """Worker id -> keys of the records it reported as uploaded (one metrics row per successful put).

    Args:
        log_dir: the directory holding ``worker-<id>.jsonl`` files.
        run: the run id.
    """
    out: dict[str, list[str]] = {}
    for path in sorted(log_dir.glob("worker-*.jsonl")):
        if _CHUNK_TAIL.search(path.stem):  # the worker's metrics chunk in a local bucket, not its own log
            continue
        wid = path.stem.removeprefix("worker-")
        rows = [r for r in read_metrics(path) if "worker/reward_mean" in r and "step" in r]
        out[wid] = [rollout_key(run, int(r["worker/version"]), wid, int(r["step"]) - 1) for r in rows]
    return out


@dataclass
class RecordAudit:
    """What every object under ``runs/<run>/rollouts/`` turned out to be.

    Args:
        keys: every listed key.
        bad: key -> why it is unreadable or invalid (empty when all are fine).
        by_worker: records per worker id (from the decoded record).
    """

    keys: list[str] = field(default_factory=list)
    bad: dict[str, str] = field(default_factory=dict)
    by_worker: collections.Counter[str] = field(default_factory=collections.Counter)


def audit_records(bucket: Bucket, run: str) -> RecordAudit:
    """Read, decode and validate every record of a run, and check each sits under the key it names.

    Args:
        bucket: the run's bucket (opened without fault injection).
        run: the run id.
    """
    contract = RunContract.from_json(bucket.get(contract_key(run)))
    audit = RecordAudit()
    for info in bucket.list(rollouts_prefix(run)):
        audit.keys.append(info.key)
        try:
            rec = RolloutRecord.decode(bucket.get(info.key))
            validate_record(rec, contract)
        except (RecordRejected, BucketError) as e:
            audit.bad[info.key] = f"{type(e).__name__}: {e}"
            continue
        named = rollout_key(run, rec.policy_version, rec.worker_id, rec.seq)
        if named != info.key:
            audit.bad[info.key] = f"record names {named}"
            continue
        audit.by_worker[rec.worker_id] += 1
    return audit


def trained_uses(rows: list[dict[str, Any]]) -> collections.Counter[str]:
    """How often each record fed an optimizer step, from the trainer's ``rollout/keys`` metric.

    Args:
        rows: the trainer's step rows.
    """
    return collections.Counter(k for r in rows for k in r["rollout/keys"])


def rejected_counts(rows: list[dict[str, Any]]) -> collections.Counter[str]:
    """Rejections by reason summed over the trainer's rows (``rollout/rejected/<reason>``).

    Args:
        rows: the trainer's metrics rows.
    """
    out: collections.Counter[str] = collections.Counter()
    for r in rows:
        for k, v in r.items():
            if k.startswith("rollout/rejected/") and v:
                out[k.removeprefix("rollout/rejected/")] += int(v)
    return out


def reward_mismatches(rows: list[dict[str, Any]]) -> int:
    """Records whose claimed rewards disagreed with the trainer's recompute, summed over rows.

    Args:
        rows: the trainer's metrics rows.
    """
    return sum(int(r.get("rollout/reward_mismatch", 0)) for r in rows)


@dataclass
class ChainAudit:
    """The weight chain rebuilt from the oldest anchor through every patch.

    Args:
        hashes: version -> state hash reached by applying the patches in order.
        anchors: anchor version -> the state hash its manifest declares.
        problems: gaps, undecodable objects, anchors that disagree with the chain.
    """

    hashes: dict[int, str] = field(default_factory=dict)
    anchors: dict[int, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def _weight_versions(bucket: Bucket, run: str) -> tuple[list[int], set[int]]:
    """(complete anchors, patches) by version, from the listing."""
    anchors = {o.version for info in bucket.list(anchors_prefix(run))
               if (o := parse_anchor_key(run, info.key)) is not None and o.name == ANCHOR_MANIFEST}
    patches = {v for info in bucket.list(patches_prefix(run)) if (v := parse_patch_key(run, info.key)) is not None}
    return sorted(anchors), patches


def _load_anchor(bucket: Bucket, run: str, plane: str, version: int) -> dict:
    manifest = json.loads(bucket.get(anchor_prefix(run, version) + ANCHOR_MANIFEST))
    check_manifest(manifest, run_id=run, version=version, plane=plane)
    return decode_anchor(bytearray(bucket.get(anchor_prefix(run, version) + ANCHOR_FILE)), manifest)


def rebuild_chain(bucket: Bucket, run: str, plane: str) -> ChainAudit:
    """Decode the oldest complete anchor and apply every later patch in order; compare with every anchor.

    A version without a patch may be an anchor (a trainer that could not verify the published state
    restarts the chain with one); a version with neither is a gap.

    Args:
        bucket: the run's bucket.
        run: the run id.
        plane: the run's weight plane.
    """
    audit = ChainAudit()
    anchors, patches = _weight_versions(bucket, run)
    if not anchors:
        audit.problems.append("no complete anchor")
        return audit
    for a in anchors:
        audit.anchors[a] = str(json.loads(bucket.get(anchor_prefix(run, a) + ANCHOR_MANIFEST))["state_hash"])
    version = anchors[0]
    try:
        state = _load_anchor(bucket, run, plane, version)
        s_hash = state_hash(state)
        audit.hashes[version] = s_hash
        for v in range(version + 1, max([*patches, *anchors]) + 1):
            if v in patches:
                state, info = apply_patch(state, bucket.get(patch_key(run, v)), run_id=run,
                                          expected_from_version=version, plane=plane, expected_from_hash=s_hash)
                s_hash = state_hash(state)
                if s_hash != info.state_hash:
                    audit.problems.append(f"patch v{v}: applied state hash {s_hash} != header {info.state_hash}")
            elif v in audit.anchors:
                state = _load_anchor(bucket, run, plane, v)
                s_hash = state_hash(state)
            else:
                audit.problems.append(f"gap: neither a patch nor an anchor at v{v}")
                break
            version = v
            audit.hashes[version] = s_hash
    except (WeightsError, ValueError) as e:
        audit.problems.append(f"after v{version}: {type(e).__name__}: {e}")
    for a, h in audit.anchors.items():
        if a in audit.hashes and audit.hashes[a] != h:
            audit.problems.append(f"anchor v{a} declares {h}, the chain reaches {audit.hashes[a]}")
    return audit


@dataclass(frozen=True)
class SyncedWeights:
    """What a fresh worker-side sync reached, hashed independently of the sync's own checks.

    Args:
        pointer: the pointer read after the sync.
        version: the version the sync returned.
        state_hash: ``state_hash`` of the returned state, computed here.
        path: how the sync got there (``anchor`` for a fresh object).
    """

    pointer: Pointer
    version: int
    state_hash: str
    path: str


def fresh_sync(bucket: Bucket, run: str, plane: str) -> SyncedWeights:
    """Sync a brand-new ``WeightSync`` to the pointer and hash the state it returns.

    Args:
        bucket: the run's bucket.
        run: the run id.
        plane: the run's weight plane.
    """
    sync = WeightSync(bucket, run, plane)
    version, state = sync.sync()
    assert sync.pointer is not None
    return SyncedWeights(sync.pointer, version, state_hash(state), str(sync.metrics.get("path")))


class PointerWatch:
    """A thread that reads ``current.json`` every ``interval_s`` and keeps each change in order.

    Args:
        bucket: the run's bucket.
        run: the run id.
        interval_s: time between reads.
    """

    def __init__(self, bucket: Bucket, run: str, interval_s: float = 0.02):
        self.bucket, self.key, self.interval_s = bucket, pointer_key(run), interval_s
        self.history: list[tuple[int, str]] = []  # (version, state hash) per observed change
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="pointer-watch")

    def __enter__(self) -> PointerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        etag: str | None = None
        while not self._stop.is_set():
            try:
                got = self.bucket.get_if_changed(self.key, etag)
            except BucketError:  # not published yet (or a transient read failure)
                got = None
            if got is not None:
                etag = got[1]
                try:
                    p = Pointer.from_json(got[0])
                    self.history.append((p.version, p.state_hash))
                except WeightsError as e:
                    self.errors.append(str(e))
            self._stop.wait(self.interval_s)


def history_problems(history: list[tuple[int, str]], chain: ChainAudit) -> list[str]:
    """Ways the observed pointer history breaks the rules: versions must strictly increase, and each
    observed (version, hash) must be what the rebuilt chain reaches at that version.

    Args:
        history: (version, state hash) per observed pointer change, in order.
        chain: the rebuilt chain.
    """
    out = []
    for (v0, h0), (v1, h1) in zip(history, history[1:], strict=False):
        if v1 <= v0:
            out.append(f"pointer went v{v0} {h0[-8:]} -> v{v1} {h1[-8:]}")
    for v, h in history:
        if chain.hashes.get(v) != h:
            out.append(f"pointer v{v} says {h}, the chain reaches {chain.hashes.get(v)}")
    return out
